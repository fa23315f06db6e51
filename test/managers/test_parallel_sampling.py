"""Parallel sampling (n > 1) in the engine (docs/design.md, "Parallel sampling"), fp32, strict memory check.

- The prompt is prefilled once: the first sample runs [0, len), every other sample only its last prompt token;
  the siblings' rows point at the first sample's whole pages, the partial last page is a copy (equal KV, other
  slots), and a sibling's prefill leaves the other samples' KV untouched.
- Sample i of a seeded request equals a plain n = 1 request seeded `seed + i`, run to run; greedy samples equal
  plain greedy; with the radix cache on and off; prompt lengths 0, 1 and P - 1 mod P.
- Under EAGLE-3 tree speculation (K {1, 8} x P {1, 64} x v1/v2; a subset by default, the rest slow): the same
  oracles, so the shared draft KV is the draft KV a single request computes.
- Aborting the whole request mid-way, samples that finish at different times and retraction under a small
  pool leak nothing.
"""

from __future__ import annotations

import queue
import time

import pytest
import torch

from spec_utils import assert_no_leak, make_eagle_head, make_sharp_target
from treepage.core import SamplingParams
from treepage.entrypoints.engine import CumulativeOutput, Engine
from treepage.server_args import ServerArgs

N = 4
SEED = 1234
NEW = 12
SAMPLED = {"temperature": 1.0, "max_new_tokens": NEW, "ignore_eos": True, "seed": SEED}
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
TREES = {1: (3, 1, 4), 8: (3, 8, 12)}  # topk -> (steps, topk, draft tokens)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("nsample")
    target = make_sharp_target(str(root / "target"), sharpen=1.5)  # not too sharp: samples differ
    return {"target": target, "EAGLE3": make_eagle_head(target, str(root / "eagle3"), "EAGLE3")}


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")


def make_engine(ckpts, page: int, cache: bool = True, topk: int | None = None, version: int = 2, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 8192)
    if topk is not None:
        steps, k, n = TREES[topk]
        kw.update(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=ckpts["EAGLE3"],
            speculative_num_steps=steps,
            speculative_eagle_topk=k,
            speculative_num_draft_tokens=n,
            disable_overlap_schedule=version == 1,
        )
    args = ServerArgs(model_path=ckpts["target"], dtype="float32", page_size=page, disable_radix_cache=not cache, **kw)
    return Engine(args)


def prompt(length: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(length * 7 + salt)
    return torch.randint(3, 120, (length,), generator=g).tolist()


class PrefillLog:
    """Wraps the engine's real prefill to record what each request computes and what its row shares. Runs on
    the scheduler thread; the test thread reads `calls` once the engine is idle."""

    def __init__(self, eng: Engine) -> None:
        self.eng = eng
        self.calls: list[dict] = []
        self.batches: list[list[str]] = []  # the rids of each prefill call
        self.problems: list[str] = []
        self._prefill = eng.worker.prefill
        eng.worker.prefill = self  # type: ignore[method-assign]

    def __call__(self, reqs, ends):
        rtt = self.eng.worker.pools.req_to_token_pool.req_to_token
        P = self.eng.args.page_size
        pools = [self.eng.worker.runner.kv_pool] + ([self.eng.worker.draft.kv_pool] if hasattr(self.eng.worker, "draft") else [])
        before = {}
        self.batches.append([r.rid for r in reqs])
        for r, end in zip(reqs, ends):
            self.calls.append({"rid": r.rid, "start": r.kv_committed_len, "end": end})
            group = r.group
            if group is None or r.output_ids or r.kv_committed_len == 0:
                continue
            donor = next((m for m in group.members if m is not r and m.row >= 0 and m.kv_committed_len >= len(r.input_ids)), None)
            if donor is None:
                continue
            c, m = r.kv_committed_len, r.cache_len
            mine, theirs = rtt[r.row, :c], rtt[donor.row, :c]
            if not torch.equal(mine[:m], theirs[:m]):
                self.problems.append(f"{r.rid}: whole prompt pages are not the donor's")
            if m < c and torch.equal(mine[m:c], theirs[m:c]):
                self.problems.append(f"{r.rid}: the partial page is the donor's, not a copy")
            if m % P or m < c // P * P:
                self.problems.append(f"{r.rid}: shares {m} positions of {c}")
            for pool in pools:
                if not torch.equal(pool.kv_data[:, :, mine[m:c]], pool.kv_data[:, :, theirs[m:c]]):
                    self.problems.append(f"{r.rid}: the copied partial page differs from the donor's KV")
            before[r.rid] = [(donor.row, pool, pool.kv_data[:, :, rtt[donor.row, : donor.kv_committed_len]].clone()) for pool in pools]
        outs = self._prefill(reqs, ends)
        for rid, saved in before.items():
            for row, pool, kv in saved:
                if not torch.equal(pool.kv_data[:, :, rtt[row, : kv.shape[2]]], kv):
                    self.problems.append(f"{rid}: its prefill changed a sibling's KV")
        return outs

    def computed(self) -> list[int]:
        return [c["end"] - c["start"] for c in self.calls]


def run_n(eng: Engine, ids: list[int], params: dict, n: int = N) -> list[list[int]]:
    outs = eng.generate(input_ids=ids, sampling_params={**params, "n": n})
    assert isinstance(outs, list) and len(outs) == n
    return [o["output_ids"] for o in outs]


def single(eng: Engine, ids: list[int], params: dict) -> list[int]:
    out = eng.generate(input_ids=ids, sampling_params=params)
    assert isinstance(out, dict)
    return out["output_ids"]


def check_group(eng: Engine, ids: list[int], params: dict, log: PrefillLog, spec: bool = False) -> list[list[int]]:
    """n samples once and again; each equals its seeded single; the prompt was prefilled once."""
    log.calls.clear()
    log.batches.clear()
    fresh = eng.scheduler.cache.num_pages == 0  # nothing cached: the first sample prefills the whole prompt
    outs = run_n(eng, ids, params)
    computed = log.computed()
    assert log.calls[0]["end"] == len(ids) and computed[1:] == [1] * (N - 1), log.calls
    assert len(log.batches) == 2, log.batches  # the first sample, then every other one in one prefill
    assert computed[0] == len(ids) or not fresh, log.calls
    assert not log.problems, log.problems
    assert run_n(eng, ids, params) == outs  # reproducible
    for i, out in enumerate(outs):
        seed = params.get("seed")
        p = {**params, "seed": seed + i} if seed is not None else params
        assert single(eng, ids, p) == out, f"sample {i}"
    if params.get("temperature", 1.0) > 0:
        assert len({tuple(o) for o in outs}) > 1, "the samples' streams are not distinct"
    else:
        assert all(o == outs[0] for o in outs)
    assert_no_leak(eng)
    return outs


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "nocache"])
def test_prefill_once_and_seeded_samples(ckpts, cache):
    page = 4
    with make_engine(ckpts, page, cache) as eng:
        log = PrefillLog(eng)
        for length in (2 * page, 2 * page + 1, 3 * page - 1):  # mod P = 0, 1, P - 1
            ids = prompt(length)
            assert eng.flush_cache() or not cache
            sampled = check_group(eng, ids, SAMPLED, log)
            greedy = check_group(eng, ids, GREEDY, log)
            assert greedy[0] == single(eng, ids, GREEDY)
            assert sampled != greedy
        # a batch of two prompts: prompt-major order, each group shares its own prompt
        a, b = prompt(9, 1), prompt(10, 2)
        outs = eng.generate(input_ids=[a, b], sampling_params={**SAMPLED, "n": 2})
        assert [o["output_ids"] for o in outs] == run_n(eng, a, SAMPLED, 2) + run_n(eng, b, SAMPLED, 2)
        assert_no_leak(eng)


def test_samples_finish_at_different_times(ckpts):
    with make_engine(ckpts, 4) as eng:
        ids = prompt(13)
        common = single(eng, ids, {**GREEDY, "max_new_tokens": 40})
        params = {**SAMPLED, "max_new_tokens": 40, "ignore_eos": False, "stop_token_ids": sorted(set(common))[:6]}
        outs = run_n(eng, ids, params)
        assert len({len(o) for o in outs}) > 1, "all samples stopped at the same step"
        for i, out in enumerate(outs):
            assert single(eng, ids, {**params, "seed": SEED + i}) == out
        assert_no_leak(eng)


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "nocache"])
def test_abort_whole_request_midway(ckpts, cache):
    with make_engine(ckpts, 4, cache) as eng:
        qs: list[queue.Queue] = [queue.Queue() for _ in range(N)]
        sp = eng.make_sampling_params({**SAMPLED, "max_new_tokens": 400})
        reqs = eng.submit_samples(prompt(11), sp, [q.put for q in qs], rid="grp")
        assert [r.rid for r in reqs] == [f"grp-{i}" for i in range(N)]
        accs = [CumulativeOutput() for _ in range(N)]
        deadline = time.monotonic() + 60
        while not all(len(a.output_ids) >= 3 for a in accs):  # every sample is decoding
            for q, a in zip(qs, accs):
                while not q.empty():
                    a.add(q.get_nowait())
            assert time.monotonic() < deadline
            time.sleep(0.01)
        eng.abort("grp")
        for q, a in zip(qs, accs):
            while not a.finished:
                a.add(q.get(timeout=30))
            assert a.meta_info["finish_reason"]["type"] == "abort"
        assert_no_leak(eng)


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "nocache"])
def test_retraction_under_a_small_pool(ckpts, cache):
    page = 4
    with make_engine(ckpts, page, cache, max_total_tokens=page * 24) as eng:
        log = PrefillLog(eng)
        ids = prompt(18)
        params = {**SAMPLED, "max_new_tokens": 40}
        outs = run_n(eng, ids, params)
        assert eng.scheduler.stats.num_retracted > 0, "the pool was not small enough to retract"
        assert not log.problems, log.problems
        for i, out in enumerate(outs):
            assert single(eng, ids, {**params, "seed": SEED + i}) == out
        greedy = run_n(eng, ids, {**GREEDY, "max_new_tokens": 40})
        assert all(g == single(eng, ids, {**GREEDY, "max_new_tokens": 40}) for g in greedy)
        assert_no_leak(eng)


SPEC_CASES = [
    pytest.param(8, 64, 2, True),
    pytest.param(1, 1, 1, False),
    pytest.param(8, 1, 1, True, marks=pytest.mark.slow),
    pytest.param(8, 64, 1, False, marks=pytest.mark.slow),
    pytest.param(1, 64, 2, True, marks=pytest.mark.slow),
    pytest.param(1, 64, 1, True, marks=pytest.mark.slow),
    pytest.param(1, 1, 2, True, marks=pytest.mark.slow),
    pytest.param(8, 1, 2, False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("topk,page,version,cache", SPEC_CASES)
def test_speculative_samples(ckpts, topk, page, version, cache):
    length = 70 if page == 64 else 9  # a partial last page to copy
    ids = prompt(length, 3)
    with make_engine(ckpts, 1 if page == 1 else 4) as plain:
        greedy_ref = single(plain, ids, GREEDY)
    with make_engine(ckpts, page, cache, topk=topk, version=version, max_total_tokens=32768) as eng:
        log = PrefillLog(eng)
        greedy = check_group(eng, ids, GREEDY, log)
        assert greedy[0] == greedy_ref  # spec on == spec off
        check_group(eng, ids, SAMPLED, log)


def test_constrained_penalised_samples_are_independent(ckpts):
    """Each sample has its own processors (grammar matcher, penalty counts): with a regex and a frequency penalty
    under tree speculation, sample i still equals the seeded single and every output follows the regex. A chain
    shared by the samples would advance one matcher by all their tokens."""
    import re

    with make_engine(ckpts, 4, topk=8, max_total_tokens=32768) as eng:
        log = PrefillLog(eng)
        params = {**SAMPLED, "regex": r"[a-z]{2,5}\.", "frequency_penalty": 0.5}
        outs = check_group(eng, prompt(9, 4), params, log)
        for out in outs:
            body = [t for t in out if t not in eng.eos_ids]
            assert len(body) < len(out), out  # the grammar ended, stop tokens follow (ignore_eos)
            assert re.fullmatch(r"[a-z]{2,5}\.", eng.tokenizer.decode(body)), eng.tokenizer.decode(body)


def test_n_validated(ckpts):
    with make_engine(ckpts, 4) as eng:
        for bad in (0, 17, -1, True):
            with pytest.raises(ValueError, match="n must be"):
                eng.generate(input_ids=[5, 6, 7], sampling_params={"n": bad, "max_new_tokens": 2})
        sp = SamplingParams(max_new_tokens=2)
        with pytest.raises(ValueError, match="n must be"):
            eng.submit_samples([5, 6, 7], sp, [lambda _: None] * 17)
        assert_no_leak(eng)
