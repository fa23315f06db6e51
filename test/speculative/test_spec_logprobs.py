"""Logprobs under tree speculation are the target's: with speculation on, every emitted token's logprob, its top
logprobs and the requested ids' logprobs equal plain decoding's (fp32, max abs diff < 1e-4), as do the prompt
logprobs, over K {1, 8} x P {1, 64} x spec v1/v2 and the adaptive schedule that changes shape every round (OFF
included). The verify row of the accepted path's j-th node gives the j-th token's entry (layers/logprobs.py).
"""

from __future__ import annotations

import queue
import random

import pytest
import torch

from spec_utils import make_perturbed_copy, make_sharp_target, standalone_engine
from treepage.core import LogprobParams
from treepage.entrypoints.engine import CumulativeOutput, Engine
from treepage.layers.logits_processor import LogitsProcessorChain, RequestLogitsProcessor
from treepage.server_args import ServerArgs

MAX_NEW = 24
TOL = 1e-4
SP = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
LP = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5, "token_ids_logprob": [3, 40, 77]}


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randint(3, 127) for _ in range(n)] for n in (1, 9, 64, 70)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A draft that mostly agrees (accepted paths run deep and through side branches); the logprob path does not
    depend on the algorithm (random EAGLE heads are rarely accepted), so STANDALONE serves every case."""
    root = tmp_path_factory.mktemp("spec_logprobs")
    target = make_sharp_target(str(root / "target"))
    return {"target": target, "draft": make_perturbed_copy(target, str(root / "standalone"), noise=0.02)}


@pytest.fixture(scope="module")
def reference(ckpts):
    eng = Engine(ServerArgs(model_path=ckpts["target"], dtype="float32", page_size=1, disable_radix_cache=True))
    try:
        return eng.generate(input_ids=prompts(), sampling_params=SP, **LP)
    finally:
        eng.shutdown()


def assert_same_logprobs(got: list[dict], ref: list[dict]) -> None:
    """Same tokens; every logprob list within TOL; the same top ids (values within TOL)."""
    worst = 0.0
    for g, r in zip(got, ref):
        assert g["output_ids"] == r["output_ids"]
        gm, rm = g["meta_info"], r["meta_info"]
        for side in ("input", "output"):
            gt, rt = gm[f"{side}_token_logprobs"], rm[f"{side}_token_logprobs"]
            assert [x[1] for x in gt] == [x[1] for x in rt]
            for a, b in zip(gt, rt):
                if b[0] is None:
                    assert a[0] is None
                    continue
                worst = max(worst, abs(a[0] - b[0]))
            for key in (f"{side}_top_logprobs", f"{side}_token_ids_logprobs"):
                for ga, ra in zip(gm[key], rm[key]):
                    if ra is None:
                        assert ga is None
                        continue
                    assert [x[1] for x in ga] == [x[1] for x in ra]
                    worst = max([worst] + [abs(x[0] - y[0]) for x, y in zip(ga, ra)])
        assert len(gm["output_token_logprobs"]) == MAX_NEW
    assert worst < TOL, worst


def spec_engine(ckpts, topk: int, page: int, version: int, **kw) -> Engine:
    return standalone_engine(ckpts["target"], ckpts["draft"], topk, page, version, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("topk", [1, 8])
def test_spec_logprobs_equal_plain(ckpts, reference, topk, page, version, monkeypatch):
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    eng = spec_engine(ckpts, topk, page, version)
    try:
        got = eng.generate(input_ids=prompts(), sampling_params=SP, **LP)
        assert_same_logprobs(got, reference)
        dbg = eng.worker.debug.to_dict()
        assert any(a >= 3 for a in dbg["accept_len_hist"]), dbg  # entries from rows deep in accepted paths
        if topk > 1:
            assert any(b >= 1 for b in dbg["branch_hist"]), dbg  # and from side branches
        eng.wait_idle()
        assert eng.memory_report()["used_rows"] == 0
    finally:
        eng.shutdown()


@pytest.mark.parametrize("version", [1, 2])
def test_adaptive_cycle_logprobs_equal_plain(ckpts, reference, version, monkeypatch):
    """Every round a different shape, OFF included: off rounds, trees of every size and the lazy catch-up."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    eng = spec_engine(
        ckpts, 8, 64, version, speculative_adaptive=True, speculative_adaptive_debug_cycle=True
    )
    try:
        assert_same_logprobs(eng.generate(input_ids=prompts(), sampling_params=SP, **LP), reference)
        assert eng.adaptive_report()["rounds"]["off"] > 0
    finally:
        eng.shutdown()


class FollowBias(RequestLogitsProcessor):
    """Path-dependent: +3 on the logit of (previous token + 1) mod V, the previous token being the last of the
    accepted history + the row's path (the prompt's last token when both are empty)."""

    def __init__(self, prompt_last: int) -> None:
        self.prompt_last = prompt_last
        self.history: list[int] = []

    def apply(self, logits: torch.Tensor, paths) -> None:
        for row, path in zip(logits, paths):
            prev = ([self.prompt_last] + self.history + list(path))[-1]
            row[(prev + 1) % row.shape[0]] += 3.0

    def accept(self, tokens) -> None:
        self.history.extend(tokens)

    def reset(self) -> None:
        self.history = []


def run_with_processor(eng: Engine, ids: list[int]) -> CumulativeOutput:
    q: queue.Queue = queue.Queue()
    req = eng._make_req(ids, eng.make_sampling_params(SP), q.put, None, LogprobParams(top_n=3))
    req.logits_processor = LogitsProcessorChain([FollowBias(ids[-1])])
    eng.scheduler.submit(req)
    acc = CumulativeOutput()
    while not acc.finished:
        acc.add(q.get(timeout=60))
    return acc


@pytest.mark.parametrize("version", [1, 2])
def test_reported_logprobs_follow_the_logits_processors(ckpts, version):
    """Logprobs come from the processed logits (penalties, bias and grammar land there): with a path-dependent
    processor, tree verify reports what plain decoding reports, and the bias shows in the values."""
    ids = prompts()[2]
    plain = Engine(ServerArgs(model_path=ckpts["target"], dtype="float32", page_size=4))
    try:
        ref = run_with_processor(plain, ids)
        unbiased = plain.generate(input_ids=ids, sampling_params=SP, return_logprob=True)
    finally:
        plain.shutdown()
    eng = spec_engine(ckpts, 8, 1, version)
    try:
        got = run_with_processor(eng, ids)
        assert any(a >= 2 for a in eng.worker.debug.to_dict()["accept_len_hist"])  # entries from path rows
    finally:
        eng.shutdown()
    assert got.output_ids == ref.output_ids
    assert [e.logprob for e in got.output_logprobs] == pytest.approx([e.logprob for e in ref.output_logprobs], abs=TOL)
    assert [[t for _, t in e.top] for e in got.output_logprobs] == [[t for _, t in e.top] for e in ref.output_logprobs]
    plain_values = [e[0] for e in unbiased["meta_info"]["output_token_logprobs"]]
    assert ref.output_ids != unbiased["output_ids"] or [e.logprob for e in ref.output_logprobs] != pytest.approx(
        plain_values, abs=1e-3
    )


@pytest.mark.parametrize("version", [1, 2])
def test_sampled_tokens_report_the_target_distribution(ckpts, version):
    """Tree speculative sampling (T = 0.8, top_p 0.9): each emitted token's logprob is the target's
    log_softmax(logits / T) at its position (transformers on the same checkpoint), whichever tree node or
    residual draw produced it."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpts["target"], dtype=torch.float32).eval()
    sp = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    eng = spec_engine(ckpts, 8, 1, version)
    try:
        outs = eng.generate(input_ids=prompts()[1:], sampling_params=sp, return_logprob=True)
        assert any(a >= 2 for a in eng.worker.debug.to_dict()["accept_len_hist"])
    finally:
        eng.shutdown()
    for ids, out in zip(prompts()[1:], outs):
        full = ids + out["output_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float() / 0.8, dim=-1)
        n = len(ids)
        want = ref[torch.arange(n - 1, len(full) - 1), torch.tensor(out["output_ids"])]
        got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, want, atol=TOL), (got - want).abs().max()
