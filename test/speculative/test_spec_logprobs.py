"""Logprobs under tree speculation are the target's: with speculation on, every emitted token's logprob, its top
logprobs and the requested ids' logprobs equal plain decoding's (fp32, max abs diff < 1e-4), as do the prompt
logprobs, over K {1, 8} x P {1, 64} x spec v1/v2 and the adaptive schedule that changes shape every round (OFF
included). The verify row of the accepted path's j-th node gives the j-th token's entry (layers/logprobs.py).
"""

from __future__ import annotations

import random

import pytest

from spec_utils import make_perturbed_copy, make_sharp_target
from treepage.entrypoints.engine import Engine
from treepage.server_args import ServerArgs

MAX_NEW = 24
TOL = 1e-4
TREES = {1: (3, 1, 4), 8: (4, 8, 16)}  # topk -> (steps, topk, draft tokens)
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
    steps, k, n = TREES[topk]
    return Engine(
        ServerArgs(
            model_path=ckpts["target"],
            dtype="float32",
            page_size=page,
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=ckpts["draft"],
            speculative_num_steps=steps,
            speculative_eagle_topk=k,
            speculative_num_draft_tokens=n,
            disable_overlap_schedule=version == 1,
            **kw,
        )
    )


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
