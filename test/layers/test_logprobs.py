"""Logprobs against the transformers oracle on the same checkpoint (fp32): prompt and output logprobs of a greedy
run, top-n, the temperature-scaled distribution of a sampled request; prompt logprobs that survive chunked
prefill, the prefix cache (hits are limited to positions that need no logits) and retraction (no position twice);
and no logprob work at all for requests that do not ask."""

from __future__ import annotations

import random

import pytest
import torch

from treepage.core import LogprobParams, Req, SamplingParams
from treepage.entrypoints.engine import Engine
from treepage.layers import logprobs as logprobs_module
from treepage.server_args import ServerArgs

TOL = 1e-4
NEW = 16
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}


def make_prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 127) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(hf, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(ids), V]: row p is the distribution of the token after position p."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float() / temperature, dim=-1)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    eng = Engine(ServerArgs(model_path=tiny_llama_dir, dtype="float32", page_size=4, disable_radix_cache=True))
    yield eng
    eng.shutdown()


def values(entries: list) -> list:
    return [e[0] for e in entries]


def assert_close_lists(got: list, want: list) -> None:
    """SGLang's per-position lists of [logprob, id, text] (or None): same ids and Nones, logprobs within TOL."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None or g is None:
            assert g is None and w is None
            continue
        assert [x[1] for x in g] == [x[1] for x in w]
        assert values(g) == pytest.approx(values(w), abs=TOL)


def test_prompt_and_output_logprobs_match_transformers(hf, plain):
    for ids in make_prompts([1, 12, 30]):
        out = plain.generate(
            input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=5
        )
        meta, full = out["meta_info"], ids + out["output_ids"]
        ref = hf_logprobs(hf, full)
        n = len(ids)
        assert [e[1] for e in meta["input_token_logprobs"]] == ids
        assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
        got_in = torch.tensor(values(meta["input_token_logprobs"][1:]))
        want_in = ref[torch.arange(n - 1), torch.tensor(ids[1:], dtype=torch.long)]
        assert torch.allclose(got_in, want_in, atol=TOL), (got_in - want_in).abs().max()
        got_out = torch.tensor(values(meta["output_token_logprobs"]))
        want_out = ref[torch.arange(n - 1, len(full) - 1), torch.tensor(out["output_ids"])]
        assert torch.allclose(got_out, want_out, atol=TOL), (got_out - want_out).abs().max()
        for j, top in enumerate(meta["output_top_logprobs"]):
            v, i = ref[n - 1 + j].topk(5)
            assert [t[1] for t in top] == i.tolist()
            assert torch.allclose(torch.tensor(values(top)), v, atol=TOL)
            assert top[0][1] == out["output_ids"][j]  # greedy picks the top entry


def test_prompt_scoring_with_no_new_tokens(hf, plain):
    """max_new_tokens 0 with prompt logprobs (how evaluation harnesses score text): a prefill, no output."""
    ids = make_prompts([14], seed=5)[0]
    out = plain.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    want = hf_logprobs(hf, ids)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(values(out["meta_info"]["input_token_logprobs"][1:]))
    assert torch.allclose(got, want, atol=TOL)
    plain.wait_idle()
    assert plain.memory_report()["used_rows"] == 0


def test_logprob_start_len_bounds(plain):
    ids = make_prompts([10])[0]
    for start, count in [(-1, 0), (10, 0), (9, 1), (4, 6)]:
        out = plain.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=start)
        entries = out["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == ids[len(ids) - count :], start
        assert len(out["meta_info"]["output_token_logprobs"]) == NEW
    with pytest.raises(ValueError, match="logprob_start_len"):
        plain.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=11)


def test_sampled_request_reports_temperature_scaled_logprobs(hf, plain):
    """SGLang's default: log_softmax(logits / T); top-p does not renormalise what is reported."""
    ids = make_prompts([9], seed=2)[0]
    sp = {"temperature": 0.7, "top_p": 0.5, "seed": 3, "max_new_tokens": NEW, "ignore_eos": True}
    out = plain.generate(input_ids=ids, sampling_params=sp, return_logprob=True, logprob_start_len=1)
    full = ids + out["output_ids"]
    ref = hf_logprobs(hf, full, temperature=0.7)
    want = ref[torch.arange(len(full) - 1), torch.tensor(full[1:])]
    got = torch.tensor(values(out["meta_info"]["input_token_logprobs"] + out["meta_info"]["output_token_logprobs"]))
    assert torch.allclose(got, want, atol=TOL), (got - want).abs().max()


def test_chunked_prefill_and_prefix_cache_keep_prompt_logprobs(tiny_llama_dir, plain):
    """Chunks of 8 at page size 4 with the prefix cache on: every prompt entry is computed, a hit never covers a
    position whose logits an entry needs, and a request that wants no prompt entries uses the cache."""
    ids = make_prompts([30], seed=4)[0]
    lp = {"return_logprob": True, "top_logprobs_num": 2}
    ref = plain.generate(input_ids=ids, sampling_params=GREEDY, logprob_start_len=0, **lp)["meta_info"]
    eng = Engine(ServerArgs(model_path=tiny_llama_dir, dtype="float32", page_size=4, chunked_prefill_size=8))
    try:
        for start, max_hit in [(5, 4), (0, 0), (-1, 28), (21, 20)]:
            out = eng.generate(input_ids=ids, sampling_params=GREEDY, logprob_start_len=start, **lp)["meta_info"]
            skip = max(start, 0) if start >= 0 else len(ids)
            want = ref["input_token_logprobs"][skip:]
            assert [e[1] for e in out["input_token_logprobs"]] == [e[1] for e in want], start
            assert max(
                [abs(a[0] - b[0]) for a, b in zip(out["input_token_logprobs"], want) if b[0] is not None] + [0.0]
            ) < TOL
            assert_close_lists(out["input_top_logprobs"], ref["input_top_logprobs"][skip:])
            assert values(out["output_token_logprobs"]) == pytest.approx(values(ref["output_token_logprobs"]), abs=TOL)
            assert out["cached_tokens"] <= max_hit, (start, out["cached_tokens"])
        assert out["cached_tokens"] > 0  # start 21: pages before position 20 come from the cache
    finally:
        eng.shutdown()


def test_retraction_delivers_each_prompt_position_once(tiny_llama_dir, plain, monkeypatch):
    """A pool that forces retractions: the re-prefill (prompt + output so far) adds no prompt entry twice and
    the output entries equal an unconstrained run's."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    prompts = make_prompts([10, 13, 18, 21], seed=1)
    sp = {**GREEDY, "max_new_tokens": 40}
    lp = {"return_logprob": True, "logprob_start_len": 0}
    ref = plain.generate(input_ids=prompts, sampling_params=sp, **lp)
    eng = Engine(ServerArgs(model_path=tiny_llama_dir, dtype="float32", page_size=4, max_total_tokens=96))
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=sp, **lp)
        assert eng.scheduler.stats.num_retracted > 0
        for o, r, ids in zip(outs, ref, prompts):
            assert o["output_ids"] == r["output_ids"]
            assert [e[1] for e in o["meta_info"]["input_token_logprobs"]] == ids
            assert values(o["meta_info"]["input_token_logprobs"][1:]) == pytest.approx(
                values(r["meta_info"]["input_token_logprobs"][1:]), abs=TOL
            )
            assert values(o["meta_info"]["output_token_logprobs"]) == pytest.approx(
                values(r["meta_info"]["output_token_logprobs"]), abs=TOL
            )
    finally:
        eng.shutdown()


def test_no_logprob_work_unless_asked(tiny_llama_dir, monkeypatch):
    """Requests that do not ask cost nothing: no logprob computation, last-row logits only, no delta keys; a
    request that asks in the same batch gets its entries (plain decode and tree verify)."""
    calls: list[int] = []
    real = logprobs_module.token_logprobs

    def counting(logits, reqs, tokens):
        calls.append(len(reqs))
        return real(logits, reqs, tokens)

    monkeypatch.setattr(logprobs_module, "token_logprobs", counting)
    spec = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": tiny_llama_dir,
            "speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}  # fmt: skip
    prompts = make_prompts([7, 11])
    for kw in ({}, spec):
        eng = Engine(ServerArgs(model_path=tiny_llama_dir, dtype="float32", page_size=4, **kw))
        try:
            outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
            assert calls == [] and all("input_token_logprobs" not in o["meta_info"] for o in outs)
            assert all(o["output_logprobs"] == [] for o in outs)
            asked = eng.generate(input_ids=prompts[0], sampling_params=GREEDY, return_logprob=True)
            assert len(asked["meta_info"]["output_token_logprobs"]) == NEW and calls
            calls.clear()
        finally:
            eng.shutdown()


def test_prefill_rows_after_a_partial_delivery():
    """A prompt prefilled again after 5 of its entries were delivered (a retraction between chunks) computes
    logits from position 4 on and labels its entries from position 5; the first prefill starts with token 0's
    null entry. Pure functions on a real logits tensor."""
    ids = list(range(3, 15))
    logits = torch.randn(len(ids), 128)
    for delivered, first_row, first_pos in [(0, 0, 0), (5, 4, 5)]:
        r = Req("r", ids, SamplingParams(temperature=0.0), lambda d: None)
        r.logprob, r.input_logprobs_len = LogprobParams(start=0), delivered
        firsts = logprobs_module.prefill_logit_starts([r], [0], [len(ids)])
        assert firsts == [first_row]
        last, prompt = logprobs_module.split_prefill_logits(logits[first_row:], [r], [len(ids)], firsts)
        assert torch.equal(last, logits[-1:])
        pos0, entries = prompt[0]
        assert pos0 == first_pos and [e.token for e in entries] == ids[first_pos:]
        want = torch.log_softmax(logits, -1)[torch.arange(first_pos, len(ids)) - 1, torch.tensor(ids[first_pos:])]
        got = [e.logprob for e in entries]
        if first_pos == 0:
            assert got[0] is None
            got, want = got[1:], want[1:]
        assert torch.allclose(torch.tensor(got), want, atol=1e-6)
