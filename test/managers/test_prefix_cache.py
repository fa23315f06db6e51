"""The radix prefix cache inside the engine (docs/design.md, "Prefix cache").

- Greedy exactness in fp32, cache on vs the plain cache-off reference, on one workload: multi-turn
  conversations, a long system prompt shared by concurrent requests, prefixes that end at, one before and one
  after a page boundary; plain decoding and tree speculation (a default subset here, the whole
  {EAGLE, EAGLE3, STANDALONE} x K {1, 8} x P {1, 4, 16, 64} x v1/v2 matrix marked slow).
- The draft KV a hit hands over equals the draft KV of a cold prefill (v1 and v2), and the pair key is what makes
  it so: the page before a changed successor token is not reused.
- Retraction and eviction under a small pool, aborts mid-stream, flush, strict accounting, zero leaks.
- Accept length with the cache on equals the cache off.
"""

from __future__ import annotations

import queue
import random

import pytest
import torch

from spec_utils import make_eagle_head, make_perturbed_copy, make_sharp_target
from treepage.entrypoints.engine import CumulativeOutput, Engine
from treepage.server_args import ServerArgs

NEW = 10
SP = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
TREES = {1: (3, 1, 4), 8: (3, 8, 12)}  # topk -> (steps, topk, draft tokens)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    target = make_sharp_target(str(root / "target"))
    return {
        "target": target,
        "STANDALONE": make_perturbed_copy(target, str(root / "standalone"), noise=0.02),
        "EAGLE": make_eagle_head(target, str(root / "eagle"), "EAGLE"),
        "EAGLE3": make_eagle_head(target, str(root / "eagle3"), "EAGLE3"),
    }


def spec_args(ckpts, algo: str, topk: int, version: int) -> dict:
    steps, k, n = TREES[topk]
    return dict(
        speculative_algorithm=algo,
        speculative_draft_model_path=ckpts[algo],
        speculative_num_steps=steps,
        speculative_eagle_topk=k,
        speculative_num_draft_tokens=n,
        disable_overlap_schedule=version == 1,
    )


def make_engine(ckpts, page: int, cache: bool = True, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 4096)
    return Engine(
        ServerArgs(
            model_path=ckpts["target"], dtype="float32", page_size=page, disable_radix_cache=not cache, **kw
        )
    )


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(3, 127) for _ in range(n)]


def workload(eng: Engine, page: int) -> tuple[list[list[int]], list[int]]:
    """Runs the workload; returns every output and every request's cached_tokens, in submission order."""
    rng = random.Random(page)
    outs: list[list[int]] = []
    cached: list[int] = []

    def batch(prompts: list[list[int]]) -> list[list[int]]:
        res = eng.generate(input_ids=prompts, sampling_params=SP)
        outs.extend(o["output_ids"] for o in res)
        cached.extend(o["meta_info"]["cached_tokens"] for o in res)
        return [o["output_ids"] for o in res]

    # Two conversations of three turns, decoded side by side; each turn resends the whole history.
    system = rand_ids(rng, 2 * page + 5)
    hist = [system + rand_ids(rng, 3), system + rand_ids(rng, 4)]
    for _ in range(3):
        got = batch(hist)
        hist = [h + o + rand_ids(rng, 3) for h, o in zip(hist, got)]
    # A long system prompt shared by concurrent requests (the second wave hits what the first left).
    long_system = rand_ids(rng, 3 * page + 7)
    for _ in range(2):
        batch([long_system + rand_ids(rng, 2) for _ in range(3)])
    # Shared prefixes ending at, one before and one after a page boundary.
    base = rand_ids(rng, 4 * page + 3)
    batch([base])
    k = 2 * page
    batch([base[: k + d] + rand_ids(rng, 3) for d in (0, -1, 1) if k + d > 0])
    return outs, cached


@pytest.fixture(scope="module")
def reference(ckpts) -> dict[int, list[list[int]]]:
    """Plain greedy with the cache off, per page size (the prompts depend on it)."""
    ref = {}
    for page in (1, 4, 16, 64):
        eng = make_engine(ckpts, page, cache=False)
        try:
            ref[page] = workload(eng, page)[0]
        finally:
            eng.shutdown()
    return ref


def run_checked(eng: Engine, page: int) -> tuple[list[list[int]], list[int]]:
    try:
        outs, cached = workload(eng, page)
        eng.wait_idle()
        mem = eng.memory_report()
        assert (mem["used_pages"], mem["request_pages"], mem["locked_pages"], mem["used_rows"]) == (
            0,
            0,
            0,
            0,
        ), mem
        assert mem["cached_pages"] == mem["evictable_pages"] > 0
        eng.scheduler.check_memory()
        assert eng.flush_cache()
        mem = eng.memory_report()
        assert mem["cached_pages"] == 0 and mem["free_pages"] == mem["total_pages"], mem
        return outs, cached
    finally:
        eng.shutdown()


@pytest.mark.parametrize("page", [1, 16])
def test_plain_cache_on_equals_off(ckpts, reference, page, monkeypatch) -> None:
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    outs, cached = run_checked(make_engine(ckpts, page), page)
    assert outs == reference[page]
    assert sum(cached) > 0
    # The first turn of a fresh engine has nothing to hit; later turns hit the history in whole pages.
    assert cached[0] == 0 and all(c % page == 0 for c in cached)


SPEC_SUBSET = [("EAGLE3", 8, 16, 2), ("EAGLE", 1, 4, 1), ("STANDALONE", 8, 64, 2), ("EAGLE3", 8, 1, 1)]
SPEC_MATRIX = [
    (a, k, p, v)
    for a in ("EAGLE", "EAGLE3", "STANDALONE")
    for k in (1, 8)
    for p in (1, 4, 16, 64)
    for v in (1, 2)
    if (a, k, p, v) not in SPEC_SUBSET
]


def _spec_case(ckpts, reference, algo, topk, page, version, monkeypatch) -> None:
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    eng = make_engine(ckpts, page, **spec_args(ckpts, algo, topk, version))
    assert eng.args.spec_version == version
    outs, cached = run_checked(eng, page)
    assert outs == reference[page]
    assert sum(cached) > 0 and all(c % page == 0 for c in cached)


@pytest.mark.parametrize("algo,topk,page,version", SPEC_SUBSET)
def test_spec_cache_on_equals_plain(ckpts, reference, algo, topk, page, version, monkeypatch) -> None:
    _spec_case(ckpts, reference, algo, topk, page, version, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("algo,topk,page,version", SPEC_MATRIX)
def test_spec_cache_on_equals_plain_matrix(ckpts, reference, algo, topk, page, version, monkeypatch) -> None:
    _spec_case(ckpts, reference, algo, topk, page, version, monkeypatch)


def _tree_kv(eng: Engine, ids: list[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(cached positions, target KV, draft KV) of the tree's pages for `ids` (read with the scheduler stopped)."""
    cache = eng.scheduler.cache
    pages = torch.tensor(cache.match_prefix(cache.key_of(ids)).pages, dtype=torch.int64)
    P = cache.P
    slots = (pages[:, None] * P + torch.arange(P)).reshape(-1)
    return (
        len(slots),
        eng.worker.runner.kv_pool.kv_data[:, :, slots],
        eng.worker.draft.kv_pool.kv_data[:, :, slots],
    )


@pytest.mark.parametrize("version", [1, 2])
def test_hit_hands_the_draft_the_cold_draft_kv(ckpts, version) -> None:
    """B shares A's tokens up to a page boundary, then its next token differs. The pair key reuses one page
    fewer than a token key would (A's draft KV at the boundary's last position was computed from A's next
    token), and every cached position's target and draft KV equals what a cold prefill of B computes."""
    P = 4
    rng = random.Random(7)
    a = rand_ids(rng, 3 * P + 2)
    b = a[: 2 * P] + [a[2 * P] % 120 + 4] + rand_ids(rng, 5)
    assert b[2 * P] != a[2 * P]
    spec = spec_args(ckpts, "EAGLE3", 8, version)

    warm = make_engine(ckpts, P, **spec)
    try:
        warm.generate(input_ids=a, sampling_params=SP)
        out_b = warm.generate(input_ids=b, sampling_params=SP)
        warm.wait_idle()
    finally:
        warm.stop_scheduler()  # the pools are read below
    assert out_b["meta_info"]["cached_tokens"] == P  # a token key would have reused 2 pages
    cold = make_engine(ckpts, P, **spec)
    try:
        cold_b = cold.generate(input_ids=b, sampling_params=SP)
        cold.wait_idle()
    finally:
        cold.stop_scheduler()
    assert cold_b["output_ids"] == out_b["output_ids"] and cold_b["meta_info"]["cached_tokens"] == 0
    ids_b = b + out_b["output_ids"]
    n_warm, tgt_w, drf_w = _tree_kv(warm, ids_b)
    n_cold, tgt_c, drf_c = _tree_kv(cold, ids_b)
    assert n_warm == n_cold >= len(b)
    torch.testing.assert_close(tgt_w, tgt_c, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(drf_w, drf_c, atol=1e-5, rtol=1e-5)
    assert drf_w.abs().sum(dim=(0, 1, 3, 4)).min() > 0, "a cached slot's draft KV was never written"
    # The negative control: A's draft KV at position 2P - 1 (from successor a[2P]) differs from B's there.
    n_a, _, drf_a = _tree_kv(warm, a)
    assert n_a >= 2 * P
    assert not torch.allclose(drf_a[:, :, 2 * P - 1], drf_c[:, :, 2 * P - 1], atol=1e-4)
    torch.testing.assert_close(drf_a[:, :, : 2 * P - 1], drf_c[:, :, : 2 * P - 1], atol=1e-5, rtol=1e-5)
    warm.shutdown()
    cold.shutdown()


@pytest.mark.parametrize("spec", [False, True])
def test_retraction_and_eviction_under_a_small_pool(ckpts, spec, monkeypatch) -> None:
    """A pool too small for the batch: cached pages are evicted first, then requests are retracted (and their
    committed pages cached); tokens stay exact and nothing leaks."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    P = 4
    rng = random.Random(11)
    shared = rand_ids(rng, 24)
    prompts = [shared + rand_ids(rng, 6) for _ in range(6)]
    params = {**SP, "max_new_tokens": 40}
    kw = spec_args(ckpts, "STANDALONE", 1, 2) if spec else {}
    ref_eng = make_engine(ckpts, P, cache=False)
    try:
        ref = [o["output_ids"] for o in ref_eng.generate(input_ids=prompts, sampling_params=params)]
    finally:
        ref_eng.shutdown()
    eng = make_engine(ckpts, P, max_total_tokens=280 if spec else 200, **kw)
    try:
        eng.generate(
            input_ids=[rand_ids(rng, 40) for _ in range(3)], sampling_params=params
        )  # fills the cache
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
        eng.wait_idle()
        st = eng.scheduler.stats
        assert st.num_retracted > 0 and st.cache_evicted_pages > 0, st
        assert got == ref
        mem = eng.memory_report()
        assert (mem["used_pages"], mem["used_rows"]) == (0, 0), mem
        eng.scheduler.check_memory()
    finally:
        eng.shutdown()


def test_abort_mid_stream_then_hit(ckpts, monkeypatch) -> None:
    """An aborted request leaves its committed whole pages cached; the same prompt then hits and is exact."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    P = 16
    prompt = rand_ids(random.Random(5), 3 * P + 1)
    eng = make_engine(ckpts, P, **spec_args(ckpts, "EAGLE3", 8, 2))
    try:
        want = eng.generate(input_ids=prompt, sampling_params=SP)["output_ids"]
        assert eng.flush_cache()
        q: queue.Queue = queue.Queue()
        req = eng.submit(prompt, eng.make_sampling_params({**SP, "max_new_tokens": 200}), q.put)
        acc = CumulativeOutput()
        while not acc.output_ids:
            acc.add(q.get(timeout=60))
        eng.abort(req.rid)
        while not acc.finished:
            acc.add(q.get(timeout=60))
        assert acc.meta_info["finish_reason"]["type"] == "abort"
        eng.wait_idle()
        assert eng.memory_report()["cached_pages"] >= 3
        again = eng.generate(input_ids=prompt, sampling_params=SP)
        assert again["output_ids"] == want and again["meta_info"]["cached_tokens"] == 3 * P
        eng.wait_idle()
        assert eng.memory_report()["used_pages"] == 0
    finally:
        eng.shutdown()


def test_accept_length_cache_on_equals_off(ckpts) -> None:
    """Same multi-turn workload, STANDALONE tree drafts: identical verify rounds with the cache on and off."""
    rounds = {}
    for cache in (False, True):
        eng = make_engine(ckpts, 4, cache=cache, **spec_args(ckpts, "STANDALONE", 8, 2))
        try:
            workload(eng, 4)
            eng.wait_idle()
            rounds[cache] = eng.worker.debug.to_dict()
        finally:
            eng.shutdown()
    assert rounds[True]["emitted"] == rounds[False]["emitted"]
    ratio = rounds[True]["rounds"] / rounds[False]["rounds"]
    assert abs(ratio - 1) <= 0.02, rounds


@pytest.mark.parametrize("spec", [False, True])
def test_chunk_boundaries_are_cached_for_concurrent_requests(ckpts, spec, monkeypatch) -> None:
    """A long prompt prefilled in 16-token chunks caches each chunk's whole pages at once: a request sharing the
    prompt, admitted while the first is still decoding, hits all of them; tokens stay exact."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    rng = random.Random(13)
    prompt = rand_ids(rng, 100)
    prompts = [prompt, prompt + rand_ids(rng, 2)]
    params = {**SP, "max_new_tokens": 30}
    kw = spec_args(ckpts, "EAGLE3", 8, 2) if spec else {}
    got = {}
    for cache in (False, True):
        eng = make_engine(ckpts, 4, cache=cache, chunked_prefill_size=16, **kw)
        try:
            got[cache] = eng.generate(input_ids=prompts, sampling_params=params)
            eng.wait_idle()
            assert eng.memory_report()["used_pages"] == 0
            eng.scheduler.check_memory()
        finally:
            eng.shutdown()
    assert [o["output_ids"] for o in got[True]] == [o["output_ids"] for o in got[False]]
    assert [o["meta_info"]["cached_tokens"] for o in got[True]] == [0, 96]


def test_decode_evicts_before_it_retracts(ckpts, monkeypatch) -> None:
    """Free pages run short mid-decode while the cache holds unlocked pages: they are evicted and no running
    request is retracted."""
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    rng = random.Random(17)
    eng = make_engine(ckpts, 4, max_total_tokens=200)  # 50 pages
    try:
        eng.generate(input_ids=rand_ids(rng, 100), sampling_params={**SP, "max_new_tokens": 20})
        eng.wait_idle()
        assert eng.memory_report()["cached_pages"] == 29  # 119 committed tokens: 29 whole pages
        outs = eng.generate(
            input_ids=[rand_ids(rng, 20) for _ in range(2)], sampling_params={**SP, "max_new_tokens": 60}
        )
        assert all(len(o["output_ids"]) == 60 for o in outs)
        st = eng.scheduler.stats
        assert st.num_retracted == 0 and st.cache_evicted_pages >= 10, st
        eng.wait_idle()
        assert eng.memory_report()["used_pages"] == 0
    finally:
        eng.shutdown()
