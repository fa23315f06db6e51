"""Adaptive speculation is exact: whatever shape each round uses (OFF included), greedy fp32 output equals plain
greedy decoding, and memory accounting stays exact while the shape changes under requests.

The debug schedule switches shape every round, cycling through every candidate and OFF, over the equivalence
matrix {EAGLE, EAGLE3, STANDALONE} x page {1, 4, 16, 64} x {spec v1, v2}, with prompts on and across page
boundaries and TREEPAGE_STRICT_MEM_CHECK=1 (the full structural check after every step).
"""

from __future__ import annotations

import queue
import random
import threading

import pytest

from spec_utils import assert_no_leak, make_eagle_head, make_perturbed_copy, make_sharp_target
from treepage.entrypoints.engine import CumulativeOutput, Engine
from treepage.mem_cache.sizing import alloc_len_for_shape, get_row_width_extra
from treepage.server_args import ServerArgs
from treepage.speculative.eagle_worker import OFF_DRAFT_SYNC_ENV, EagleWorker

MAX_NEW = 40
PAGES = (1, 4, 16, 64)
SP = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
TREE = (4, 8, 16)  # candidates (4,8,16), (3,4,12), (3,2,6), (3,1,4), (1,1,2), then OFF


def prompts_for(page: int, seed: int) -> list[list[int]]:
    """Lengths P, P - 1, 2P + 3, 3P and a random one: on and across page boundaries."""
    rng = random.Random(seed)
    lens = [page, max(page - 1, 1), 2 * page + 3, 3 * page, rng.randint(5, 40)]
    return [[rng.randint(3, 127) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    target = make_sharp_target(str(root / "target"))
    return {
        "target": target,
        "STANDALONE": make_perturbed_copy(target, str(root / "standalone"), noise=0.02),
        "EAGLE": make_eagle_head(target, str(root / "eagle"), "EAGLE"),
        "EAGLE3": make_eagle_head(target, str(root / "eagle3"), "EAGLE3"),
    }


@pytest.fixture(scope="module")
def reference(ckpts):
    eng = Engine(ServerArgs(model_path=ckpts["target"], dtype="float32", page_size=1))
    try:
        return {
            page: [
                o["output_ids"] for o in eng.generate(input_ids=prompts_for(page, page), sampling_params=SP)
            ]
            for page in PAGES
        }
    finally:
        eng.shutdown()


def cycling_engine(ckpts, algo: str, page: int, version: int, **kw) -> Engine:
    S, K, N = TREE
    return Engine(
        ServerArgs(
            model_path=ckpts["target"],
            dtype="float32",
            page_size=page,
            speculative_algorithm=algo,
            speculative_draft_model_path=ckpts[algo],
            speculative_num_steps=S,
            speculative_eagle_topk=K,
            speculative_num_draft_tokens=N,
            disable_overlap_schedule=version == 1,
            speculative_adaptive=True,
            speculative_adaptive_debug_cycle=True,
            **kw,
        )
    )


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("algo", ["STANDALONE", "EAGLE", "EAGLE3"])
def test_cycling_shapes_is_exact(ckpts, reference, algo, page, version, monkeypatch):
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    eng = cycling_engine(ckpts, algo, page, version)
    try:
        assert eng.args.spec_version == version
        # Rows are sized for the largest candidate, so every shape passes the row-width check after a switch.
        alloc = max(alloc_len_for_shape(page, k, s, n) for s, k, n in eng.args.speculative_shapes)
        assert alloc == alloc_len_for_shape(page, 8, 4, 16)
        assert eng.memory_report()["row_width"] == eng.context_len + get_row_width_extra(eng.args)
        prompts = prompts_for(page, page)
        batch = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=SP)]
        assert batch == reference[page]
        single = eng.generate(input_ids=prompts[1], sampling_params=SP)
        assert single["output_ids"] == reference[page][1]
        rounds = eng.get_server_info()["speculative_adaptive"]["rounds"]
        assert set(rounds) == {"4x8x16", "3x4x12", "3x2x6", "3x1x4", "1x1x2", "off"}
        assert min(rounds.values()) >= 2, rounds  # every shape, and OFF, ran more than once
        assert_no_leak(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("algo", ["STANDALONE", "EAGLE3"])
def test_eager_draft_sync_is_exact(ckpts, reference, algo, version, monkeypatch):
    """The alternative to the lazy catch-up (a one-token draft extend per OFF round) gives the same tokens."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    monkeypatch.setenv(OFF_DRAFT_SYNC_ENV, "eager")
    eng = cycling_engine(ckpts, algo, 16, version)
    try:
        assert eng.worker.off_draft_sync == "eager"
        out = [o["output_ids"] for o in eng.generate(input_ids=prompts_for(16, 16), sampling_params=SP)]
        assert out == reference[16]
        assert_no_leak(eng)
    finally:
        eng.shutdown()


def test_spec_v2_runs_off_rounds_on_the_scheduler_thread(ckpts, reference, monkeypatch):
    """Under spec v2 a speculative round runs on the forward thread and an OFF round on the scheduler thread, as the
    plain worker's decode; across every switch (a tree in flight, then OFF) the rounds come back in order, and
    the draft's catch-up after OFF is timed apart from the round it precedes."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    ran: list[tuple[str, str]] = []
    original = EagleWorker.timed_round

    def timed_round(self, reqs, allocated, shape):
        ran.append((shape.label, threading.current_thread().name))
        return original(self, reqs, allocated, shape)

    observed: list[tuple[str, int, int]] = []  # per round in order: shape, batch, tokens the draft caught up
    original_observe = EagleWorker.observe

    def observe(self, shape, outs, timing, lap=None):
        observed.append((shape.label, len(outs), timing.catchup_tokens))
        return original_observe(self, shape, outs, timing, lap)

    monkeypatch.setattr(EagleWorker, "timed_round", timed_round)
    monkeypatch.setattr(EagleWorker, "observe", observe)
    eng = cycling_engine(ckpts, "EAGLE3", 4, 2)
    try:
        out = [o["output_ids"] for o in eng.generate(input_ids=prompts_for(4, 4), sampling_params=SP)]
        assert out == reference[4]
        # the round after an OFF round of the same batch first catches the draft up over one token per request,
        # timed apart from the round; no other round catches up
        after_off = [(a, b) for a, b in zip(observed, observed[1:]) if a[0] == "off" and b[0] != "off" and a[1] == b[1]]
        assert after_off and all(b[2] == b[1] for _, b in after_off), observed
        assert all(b[2] == 0 for a, b in zip(observed, observed[1:]) if a[0] != "off"), observed
        on_forward: dict[str, set[bool]] = {}  # per shape: did its rounds run on the forward thread
        for label, thread in ran:
            on_forward.setdefault(label, set()).add(thread.startswith("treepage-forward"))
        assert on_forward.pop("off") == {False}
        assert on_forward and all(v == {True} for v in on_forward.values()), on_forward
        after_tree = [b for a, b in zip(ran, ran[1:]) if a[0] != "off" and b[0] == "off"]
        assert after_tree, "the schedule never switched from a tree to OFF"
        assert_no_leak(eng)
    finally:
        eng.shutdown()


def _collect(q: queue.Queue) -> dict:
    acc = CumulativeOutput()
    while not acc.finished:
        acc.add(q.get(timeout=120))
    return acc.snapshot()


@pytest.mark.parametrize("version", [1, 2])
def test_finish_abort_and_retraction_while_the_shape_changes(ckpts, reference, version, monkeypatch):
    """A small KV pool forces retraction; a request finishes early, one is aborted, one samples, all while the
    shape changes every round. The greedy ones keep the plain greedy tokens; nothing leaks."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    page = 4
    # alloc_len for (4, 8, 16) at P = 4: 2 pages x 4 x 8 = 64 tokens, the v1 reserve (128 under v2). The pool
    # admits two or three requests, whose growth then forces retraction; each alone fits.
    tokens = 240 if version == 1 else 320
    eng = cycling_engine(ckpts, "EAGLE3", page, version, max_total_tokens=tokens, max_running_requests=5)
    try:
        prompts = prompts_for(page, page)
        params = [dict(SP) for _ in prompts]
        params[4]["max_new_tokens"] = 7  # finishes early, mid-cycle
        params[2] = {"temperature": 0.8, "seed": 7, "max_new_tokens": MAX_NEW, "ignore_eos": True}  # sampled
        sinks = [queue.Queue() for _ in prompts]
        reqs = [
            eng.submit(p, eng.make_sampling_params(sp), q.put, rid=f"r{i}")
            for i, (p, sp, q) in enumerate(zip(prompts, params, sinks))
        ]
        first = sinks[3].get(timeout=120)  # r3 has started producing output: abort it mid-generation
        eng.abort(reqs[3].rid)
        outs = [_collect(q) if i != 3 else None for i, q in enumerate(sinks)]
        aborted = CumulativeOutput()
        aborted.add(first)
        while not aborted.finished:
            aborted.add(sinks[3].get(timeout=120))
        assert aborted.snapshot()["meta_info"]["finish_reason"]["type"] in ("abort", "length")
        assert eng.scheduler.stats.num_retracted > 0
        assert len(outs[2]["output_ids"]) == MAX_NEW  # sampling runs through every shape too
        for i, o in enumerate(outs):
            if o is None or i == 2:
                continue
            want = reference[page][i][: params[i]["max_new_tokens"]]
            assert o["output_ids"] == want, i
        assert_no_leak(eng)
    finally:
        eng.shutdown()
