"""Penalties, logit_bias and min_new_tokens (layers/penalties.py).

Unit: each processor against an independent oracle (transformers' RepetitionPenaltyLogitsProcessor; hand-computed
values for frequency / presence / bias / the min-tokens mask), row by row, where a tree-verify row's history is the
accepted output + its path. Engine: penalised and biased greedy output with speculation equals plain decoding in
fp32 over K {1, 8} x P {1, 64} x spec v1 / v2, under the adaptive debug cycle (OFF rounds included) and through a
retraction, with zero leaked pages; seeded sampling with penalties is reproducible.
"""

from __future__ import annotations

import queue
import random

import pytest
import torch

from spec_utils import (
    assert_no_leak,
    make_eagle_head,
    make_perturbed_copy,
    make_sharp_target,
    standalone_engine,
)
from treepage.core import Req, SamplingParamError, SamplingParams
from treepage.entrypoints.engine import CumulativeOutput, Engine
from treepage.layers.logits_processor import LogitsProcessorChain, commit, process_logits, sync
from treepage.layers.penalties import LogitBias, MinNewTokens, OutputPenalties, build_chain
from treepage.server_args import ServerArgs

V = 16


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3  # both signs: the repetition penalty treats them differently


# ---- processors against oracles ------------------------------------------------------------------------------
HISTORY = [3, 5, 5, 9]
PATHS = [[], [5], [7, 7], [7, 7, 12], [0]]  # a verify tree's rows: root, children, a grandchild


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    proc = OutputPenalties(V, "cpu", repetition=penalty)
    proc.accept(HISTORY[:1])
    proc.accept(HISTORY[1:])  # incremental: the same as one accept of the whole history
    logits = _logits(len(PATHS))
    want = logits.clone()
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, path in enumerate(PATHS):
        want[i : i + 1] = hf(torch.tensor([HISTORY + path]), logits[i : i + 1].clone())
    proc.apply(logits, PATHS)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)


def test_frequency_and_presence_by_hand():
    proc = OutputPenalties(V, "cpu", frequency=0.5, presence=0.25)
    proc.accept(HISTORY)
    logits = torch.zeros(len(PATHS), V)
    proc.apply(logits, PATHS)
    # row i: -(0.5 * count + 0.25 * [count > 0]) over HISTORY + PATHS[i]
    want = torch.zeros(len(PATHS), V)
    want[:, 3] = -0.75  # once in the history
    want[:, 5] = -1.25  # twice
    want[:, 9] = -0.75
    want[1, 5] = -1.75  # the path adds a third 5
    want[2, 7] = want[3, 7] = -1.25  # the path's two 7s
    want[3, 12] = -0.75
    want[4, 0] = -0.75
    torch.testing.assert_close(logits, want, rtol=0, atol=0)


def test_logit_bias_by_hand():
    proc = LogitBias({2: 100.0, 11: -3.5}, "cpu")
    logits = _logits(3)
    want = logits.clone()
    want[:, 2] += 100.0
    want[:, 11] -= 3.5
    proc.apply(logits, [[], [4], [4, 2]])
    torch.testing.assert_close(logits, want, rtol=0, atol=0)


def test_min_new_tokens_masks_stop_tokens_until_each_row_is_long_enough():
    proc = MinNewTokens(4, {2, 13}, "cpu")
    proc.accept([8, 8])  # two accepted: rows need a path of >= 2 tokens to be long enough
    logits = _logits(4)
    want = logits.clone()
    paths = [[], [5], [5, 6], [5, 6, 2]]
    for i in (0, 1):
        want[i, [2, 13]] = float("-inf")
    proc.apply(logits, paths)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    proc.reset()
    logits = _logits(1)
    proc.apply(logits, [[]])
    assert logits[0, 2] == float("-inf") and logits[0, 13] == float("-inf")


def _req(sp: SamplingParams, eos: set[int] | None = None) -> Req:
    return Req("r", [1, 2, 3], sp, lambda _: None, logits_processor=build_chain(sp, eos or {2}, V, "cpu"))


def test_neutral_params_build_no_chain_and_cost_nothing():
    assert build_chain(SamplingParams(), {2}, V, "cpu") is None
    assert build_chain(SamplingParams(min_new_tokens=5, ignore_eos=True), {2}, V, "cpu") is None
    logits = _logits(2)
    reqs = [_req(SamplingParams()), _req(SamplingParams(temperature=0))]
    assert process_logits(logits, reqs) is logits  # no copy


def test_verify_rows_of_several_requests_each_see_their_own_path():
    """process_logits over B x N rows: each request's rows get its own chain, with its own paths."""
    sp_a = SamplingParams(frequency_penalty=1.0, logit_bias={4: 2.0})
    sp_b = SamplingParams(repetition_penalty=2.0, min_new_tokens=3, max_new_tokens=8, stop_token_ids=[13])
    reqs = [_req(sp_a), _req(SamplingParams()), _req(sp_b)]
    commit(reqs, [[4, 4], [1], [6]])
    paths = [[[], [4], [6, 4]], [[], [1], [1, 1]], [[], [6], [6, 9]]]
    logits = _logits(9, seed=1)
    out = process_logits(logits, reqs, paths)
    want = logits.clone()
    for b, hist in [(0, [4, 4]), (2, [6])]:
        for n, path in enumerate(paths[b]):
            row = want[b * 3 + n]
            seen = hist + path
            if b == 0:  # the penalty, then the bias
                row[4] -= seen.count(4)
                row[6] -= seen.count(6)
                row[4] += 2.0
            else:
                for t in set(seen):
                    row[t] = row[t] * 2.0 if row[t] < 0 else row[t] / 2.0
                if len(seen) < 3:
                    row[[2, 13]] = float("-inf")
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert torch.equal(out[3:6], logits[3:6])  # the plain request's rows are untouched


def test_sync_replays_an_output_cut_back_by_retraction():
    sp = SamplingParams(frequency_penalty=1.0, min_new_tokens=4, max_new_tokens=8)
    req = _req(sp)
    commit([req], [[5, 5, 7]])  # emitted, but the request was retracted after keeping only [5]
    req.output_ids = [5]
    sync([req])
    chain = req.logits_processor
    assert isinstance(chain, LogitsProcessorChain) and chain.history == [5]
    pen, mnt = chain.processors
    assert isinstance(pen, OutputPenalties) and isinstance(mnt, MinNewTokens)
    assert pen.counts[5] == 1 and pen.counts[7] == 0 and pen.seen == {5} and mnt.accepted == 1
    sync([req])  # already in step: nothing replayed
    assert pen.counts[5] == 1


@pytest.mark.parametrize(
    "field,value",
    [("frequency_penalty", 2.5), ("frequency_penalty", float("nan")), ("presence_penalty", -2.01),
     ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("logit_bias", {"x": 1.0}),
     ("logit_bias", {"3": 100.5}), ("logit_bias", {str(V): 1.0}), ("logit_bias", {"-1": 1.0}),
     ("logit_bias", [1, 2]), ("min_new_tokens", -1), ("min_new_tokens", 9)],
)  # fmt: skip
def test_invalid_values_name_the_field(field, value):
    sp = SamplingParams(max_new_tokens=8, **{field: value})
    with pytest.raises(SamplingParamError) as exc:
        sp.validate(V)
    assert exc.value.param == field and field in str(exc.value)


def test_logit_bias_keys_become_token_ids():
    sp = SamplingParams(logit_bias={"3": 1, 4: -2.5}, frequency_penalty=-2, presence_penalty=2)
    sp.validate(V)
    assert sp.logit_bias == {3: 1.0, 4: -2.5}


# ---- speculation on == speculation off (fp32, greedy) ----------------------------------------------------------
MAX_NEW = 32
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
FORCED = 7  # a token plain decoding never emits here; logit_bias forces it
PARAMS = [
    # stop at token 10 (plain decoding's first token for this prompt) only after 8 tokens; EOS masked too
    {"temperature": 0, "max_new_tokens": MAX_NEW, "min_new_tokens": 8, "stop_token_ids": [10],
     "frequency_penalty": 0.3},
    {**GREEDY, "repetition_penalty": 1.3},
    {**GREEDY, "logit_bias": {str(FORCED): 6.0}, "frequency_penalty": 2.0},
    {**GREEDY, "frequency_penalty": 0.5, "presence_penalty": 0.3},
    GREEDY,  # a plain request in the same batch
]


def _prompts() -> list[list[int]]:
    """Lengths on and across page boundaries of P = 64 (and P = 1)."""
    rng = random.Random(0)
    return [[rng.randint(3, 127) for _ in range(n)] for n in (3, 17, 63, 64, 70)]


def _run(eng: Engine, params: list[dict], prompts: list[list[int]] | None = None) -> list[list[int]]:
    sinks: list[queue.Queue] = [queue.Queue() for _ in params]
    for ids, sp, q in zip(prompts or _prompts(), params, sinks):
        eng.submit(ids, eng.make_sampling_params(sp), q.put)
    outs = []
    for q in sinks:
        acc = CumulativeOutput()
        while not acc.finished:
            acc.add(q.get(timeout=120))
        outs.append(acc.output_ids)
    return outs


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("penalties")
    target = make_sharp_target(str(root / "target"))
    return {
        "target": target,
        "draft": make_perturbed_copy(target, str(root / "draft"), noise=0.02),
        # an EAGLE-3 head whose draft vocabulary lacks FORCED: it can never propose that token
        "eagle3": make_eagle_head(target, str(root / "eagle3"), "EAGLE3", draft_vocab_size=64, never_draft=(FORCED,)),
    }


@pytest.fixture(scope="module")
def reference(ckpts):
    """Plain decoding: unpenalised and penalised outputs."""
    eng = Engine(ServerArgs(model_path=ckpts["target"], dtype="float32", page_size=1))
    try:
        plain = _run(eng, [GREEDY] * len(PARAMS))
        penalised = _run(eng, PARAMS)
    finally:
        eng.shutdown()
    # the parameters matter: every processed request differs from plain decoding
    assert plain[0][0] == 10 and 10 not in penalised[0][:8] and penalised[0][8:] == [10]  # stops once allowed
    assert all(penalised[i] != plain[i] for i in range(4)) and penalised[4] == plain[4]
    assert FORCED in penalised[2] and not any(FORCED in o for o in plain)
    return penalised


def _spec_engine(ckpts, topk: int, page: int, version: int, **kw) -> Engine:
    return standalone_engine(ckpts["target"], ckpts["draft"], topk, page, version, **kw)


def _check_exact(eng: Engine, reference: list[list[int]]) -> None:
    assert _run(eng, PARAMS) == reference
    dbg = eng.worker.debug.to_dict()
    assert any(a >= 3 for a in dbg["accept_len_hist"]), dbg  # paths of several drafted tokens were accepted
    assert_no_leak(eng)


@pytest.mark.parametrize(
    "version,page,topk",
    [pytest.param(v, p, k, marks=[] if (v, p, k) == (2, 64, 8) else [pytest.mark.slow])  # one case by default
     for v in (1, 2) for p in (1, 64) for k in (1, 8)],
)  # fmt: skip
def test_penalised_speculation_equals_plain(ckpts, reference, version, page, topk, monkeypatch):
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    eng = _spec_engine(ckpts, topk, page, version)
    try:
        assert eng.args.spec_version == version
        _check_exact(eng, reference)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("version", [1, 2])
def test_penalised_adaptive_debug_cycle_equals_plain(ckpts, reference, version, monkeypatch):
    """Every round changes shape, OFF rounds included: the processors see every emitted token either way."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    eng = _spec_engine(ckpts, 8, 4, version, speculative_adaptive=True, speculative_adaptive_debug_cycle=True)
    try:
        _check_exact(eng, reference)
        assert eng.get_server_info()["speculative_adaptive"]["rounds"]["off"] > 0
    finally:
        eng.shutdown()


@pytest.mark.parametrize("version", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_a_biased_token_the_draft_cannot_propose(ckpts, reference, version, monkeypatch):
    """Every FORCED token after the first comes from a verify row whose tree never holds it (the bonus token)."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    eng = Engine(
        ServerArgs(
            model_path=ckpts["target"],
            dtype="float32",
            page_size=64,
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=ckpts["eagle3"],
            speculative_num_steps=4,
            speculative_eagle_topk=8,
            speculative_num_draft_tokens=16,
            disable_overlap_schedule=version == 1,
        )
    )
    try:
        drafted = eng.worker.draft.model.map_to_target_ids(torch.arange(64))
        assert FORCED not in drafted.tolist()
        assert _run(eng, PARAMS) == reference
        assert reference[2].count(FORCED) >= 2
        assert_no_leak(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("version,pool", [(1, 160), (2, 320)])  # v2 reserves twice the KV per request
def test_retracted_penalised_requests_equal_plain(ckpts, version, pool, monkeypatch):
    """A KV pool too small for the batch: retracted requests re-prefill with their output so far (under spec v2
    the tokens of a round drained at retraction are dropped), their processors re-synced to it, and still emit
    plain decoding's tokens."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    rng = random.Random(1)
    short = [[rng.randint(3, 127) for _ in range(n)] for n in (4, 3, 11, 12, 20)]  # all admitted, then grow
    plain = Engine(ServerArgs(model_path=ckpts["target"], dtype="float32", page_size=1))
    try:
        want = _run(plain, PARAMS, short)
    finally:
        plain.shutdown()
    eng = _spec_engine(ckpts, 8, 4, version, max_total_tokens=pool, max_running_requests=5)
    try:
        assert _run(eng, PARAMS, short) == want
        assert eng.scheduler.stats.num_retracted > 0
        assert_no_leak(eng)
    finally:
        eng.shutdown()


def test_seeded_sampling_with_penalties_is_reproducible(ckpts):
    """One request at a time (a speculative batch shares one generator in tree sampling)."""
    sampled = {"temperature": 0.9, "max_new_tokens": MAX_NEW, "ignore_eos": True, "frequency_penalty": 0.7,
               "presence_penalty": 0.2, "repetition_penalty": 1.1, "logit_bias": {str(FORCED): 2.0}}  # fmt: skip
    prompt = _prompts()[2]
    eng = _spec_engine(ckpts, 8, 64, 2)
    try:
        a, b, c = (eng.generate(input_ids=prompt, sampling_params={**sampled, "seed": s}) for s in (1, 1, 2))
        assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
        assert a["output_ids"] != c["output_ids"]  # the seed matters
        assert_no_leak(eng)
    finally:
        eng.shutdown()
