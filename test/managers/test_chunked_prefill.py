"""Chunked prefill (--chunked-prefill-size): identical tokens to one-piece prefill at page sizes 1, 16 and 64 with
chunk boundaries on and off page boundaries, for plain decoding and tree speculation (v1 and v2); running
requests keep decoding between the chunks of a long prompt; strict accounting throughout, zero leaks after."""

from __future__ import annotations

import queue
import random
import threading

import pytest

from spec_utils import make_eagle_head, make_sharp_target
from treepage.entrypoints.engine import CumulativeOutput, Engine
from treepage.server_args import ServerArgs

NEW = 12
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
SAMPLED = {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": NEW, "ignore_eos": True, "seed": 5}
CHUNKS = (7, 16, 64)  # off every page boundary; on P = 16's; on P = 16's and P = 64's


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randint(3, 127) for _ in range(n)] for n in (150, 64, 129, 5)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    target = make_sharp_target(str(root / "target"))
    return {"target": target, "EAGLE3": make_eagle_head(target, str(root / "eagle3"), "EAGLE3")}


def engine(path: str, chunk: int, page: int, **kw) -> Engine:
    return Engine(
        ServerArgs(
            model_path=path,
            dtype="float32",
            page_size=page,
            chunked_prefill_size=chunk,
            max_total_tokens=4096,
            **kw,
        )
    )


def run(eng: Engine, params: dict) -> list[list[int]]:
    try:
        outs = [o["output_ids"] for o in eng.generate(input_ids=prompts(), sampling_params=params)]
        eng.wait_idle()
        mem = eng.memory_report()
        assert (mem["used_pages"], mem["used_rows"]) == (0, 0), mem
        eng.scheduler.check_memory()
        return outs
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def reference(ckpts) -> dict[str, list[list[int]]]:
    return {
        name: run(engine(ckpts["target"], -1, 1), params)
        for name, params in (("greedy", GREEDY), ("sampled", SAMPLED))
    }


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_plain_chunked_equals_unchunked(ckpts, reference, chunk, page, monkeypatch) -> None:
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    assert run(engine(ckpts["target"], chunk, page), GREEDY) == reference["greedy"]
    assert run(engine(ckpts["target"], chunk, page), SAMPLED) == reference["sampled"]


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("chunk", [7, 16])
def test_tree_speculation_chunked_equals_plain(ckpts, reference, chunk, page, version, monkeypatch) -> None:
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    spec = dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=ckpts["EAGLE3"],
        speculative_num_steps=3,
        speculative_eagle_topk=4,
        speculative_num_draft_tokens=8,
        disable_overlap_schedule=version == 1,
    )
    eng = engine(ckpts["target"], chunk, page, **spec)
    assert eng.args.spec_version == version
    assert run(eng, GREEDY) == reference["greedy"]


def test_running_requests_decode_between_chunks(ckpts) -> None:
    """A 300-token prompt in 16-token chunks: the running request gets tokens while the long one prefills."""
    eng = engine(ckpts["target"], 16, 16)
    try:
        events: list[str] = []
        lock = threading.Lock()

        def sink(tag: str, q: queue.Queue):
            def put(delta: dict) -> None:
                with lock:
                    events.append(tag)
                q.put(delta)

            return put

        short_q: queue.Queue = queue.Queue()
        long_q: queue.Queue = queue.Queue()
        sp = eng.make_sampling_params({"temperature": 0, "max_new_tokens": 200, "ignore_eos": True})
        eng.submit([5, 6, 7, 8], sp, sink("short", short_q))
        while short_q.empty():
            pass
        long_prompt = [random.Random(1).randint(3, 127) for _ in range(300)]
        eng.submit(long_prompt, eng.make_sampling_params(GREEDY), sink("long", long_q))
        outs = []
        for q in (long_q, short_q):
            acc = CumulativeOutput()
            while not acc.finished:
                acc.add(q.get(timeout=120))
            outs.append(acc.snapshot())
        first_long = events.index("long")
        # ~19 chunks before the long request's first token; a decode round ran between every two of them.
        assert events[:first_long].count("short") >= 300 // 16
        assert len(outs[0]["output_ids"]) == NEW and len(outs[1]["output_ids"]) == 200
        eng.wait_idle()
        assert eng.memory_report()["used_pages"] == 0
    finally:
        eng.shutdown()


def test_abort_and_retraction_while_chunking(ckpts, monkeypatch) -> None:
    """A chunked request aborted mid-prefill, and a pool so small that requests get retracted: nothing leaks and
    the survivors keep the unchunked tokens."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    longer = {**GREEDY, "max_new_tokens": 80}
    ref = run(engine(ckpts["target"], -1, 16), longer)
    eng = engine(ckpts["target"], 16, 16)
    try:
        long_q: queue.Queue = queue.Queue()
        req = eng.submit(list(range(3, 120)) * 2, eng.make_sampling_params(GREEDY), long_q.put)
        eng.abort(req.rid)
        acc = CumulativeOutput()
        while not acc.finished:
            acc.add(long_q.get(timeout=60))
        assert acc.meta_info["finish_reason"]["type"] in ("abort", "length")
        eng.wait_idle()
        assert eng.memory_report()["used_pages"] == 0
    finally:
        eng.shutdown()
    small = Engine(
        ServerArgs(
            model_path=ckpts["target"],
            dtype="float32",
            page_size=16,
            chunked_prefill_size=16,
            max_total_tokens=320,
        )
    )
    try:
        assert run(small, longer) == ref
        assert small.scheduler.stats.num_retracted > 0
    finally:
        small.shutdown()
