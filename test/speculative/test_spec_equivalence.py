"""Greedy equivalence: every speculative configuration emits exactly the plain-decoding tokens.

Matrix: {EAGLE, EAGLE3, STANDALONE} x topk {1, 4, 8} x page {1, 4, 16, 64} x {spec v1, v2} x batch {1, 5},
with prompt lengths whose L mod P is 0, P - 1 and other values, and generations that cross pages.
Every run ends with zero used pages and rows; TREEPAGE_STRICT_MEM_CHECK=1 checks after every step.
"""

from __future__ import annotations

import random

import pytest

from spec_utils import make_eagle_head, make_perturbed_copy, make_sharp_target
from treepage.entrypoints.engine import Engine
from treepage.server_args import ServerArgs

MAX_NEW = 40
TREES = {1: (3, 1, 4), 4: (4, 4, 12), 8: (4, 8, 16)}  # topk -> (steps, topk, draft tokens)
PAGES = (1, 4, 16, 64)
SP = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = make_sharp_target(str(root / "target"))
    return {
        "target": target,
        "STANDALONE": make_perturbed_copy(target, str(root / "standalone"), noise=0.02),
        "EAGLE": make_eagle_head(target, str(root / "eagle"), "EAGLE"),
        "EAGLE3": make_eagle_head(target, str(root / "eagle3"), "EAGLE3"),
    }


def prompts_for(page: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [page, max(page - 1, 1), 2 * page + 3, 3 * page, rng.randint(5, 40)]
    return [[rng.randint(3, 127) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module")
def reference(ckpts):
    """Plain greedy outputs, one engine (page-size invariance of plain decoding is tested elsewhere)."""
    eng = Engine(ServerArgs(model_path=ckpts["target"], dtype="float32", page_size=1))
    try:
        out = {}
        for page in PAGES:
            ps = prompts_for(page, page)
            out[page] = [o["output_ids"] for o in eng.generate(input_ids=ps, sampling_params=SP)]
        return out
    finally:
        eng.shutdown()


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("topk", [1, 4, 8])
@pytest.mark.parametrize("algo", ["STANDALONE", "EAGLE", "EAGLE3"])
def test_greedy_equivalence(ckpts, reference, algo, topk, page, version, monkeypatch):
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    steps, k, n = TREES[topk]
    eng = Engine(
        ServerArgs(
            model_path=ckpts["target"],
            dtype="float32",
            page_size=page,
            speculative_algorithm=algo,
            speculative_draft_model_path=ckpts[algo],
            speculative_num_steps=steps,
            speculative_eagle_topk=k,
            speculative_num_draft_tokens=n,
            disable_overlap_schedule=version == 1,
        )
    )
    try:
        assert eng.args.spec_version == version
        prompts = prompts_for(page, page)
        batch = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=SP)]
        assert batch == reference[page]
        single = eng.generate(input_ids=prompts[1], sampling_params=SP)
        assert single["output_ids"] == reference[page][1]
        assert single["meta_info"]["spec_verify_ct"] > 0
        eng.wait_idle()
        mem = eng.memory_report()
        assert mem["used_pages"] == 0 and mem["used_rows"] == 0
    finally:
        eng.shutdown()


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("page,topk", [(4, 8), (16, 4), (64, 8)])
def test_acceptance_reaches_deep_and_side_branches(ckpts, reference, page, topk, version):
    """With a draft that mostly agrees, accepted paths reach depth >= 3 and run through branches t >= 1,
    so the holey layout (duplicated tails, per-branch pages) is what the accepted tokens were drafted on."""
    steps, k, n = TREES[topk]
    eng = Engine(
        ServerArgs(
            model_path=ckpts["target"],
            dtype="float32",
            page_size=page,
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=ckpts["STANDALONE"],
            speculative_num_steps=steps,
            speculative_eagle_topk=k,
            speculative_num_draft_tokens=n,
            disable_overlap_schedule=version == 1,
        )
    )
    try:
        prompts = prompts_for(page, page)
        out = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=SP)]
        assert out == reference[page]
        dbg = eng.worker.debug.to_dict()
        assert any(a >= 4 for a in dbg["accept_len_hist"]), dbg  # root + >= 3 accepted drafts
        assert any(b >= 1 for b in dbg["branch_hist"]), dbg
        info = eng.get_server_info()
        assert info["avg_spec_accept_length"] > 1.5
    finally:
        eng.shutdown()
