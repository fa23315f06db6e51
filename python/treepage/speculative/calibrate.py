"""Start-up calibration of adaptive speculation: time one round of every candidate shape (and OFF) at a few
batch sizes on the machine the server runs on, and record the accept length each shape reaches on a few chat
prompts over their first ~100 tokens (the prior of the online estimate). The result is cached in a JSON file keyed
by model, draft (their weight files included), device, dtype and torch version, so a restart reuses it and a
replaced head does not (docs/design.md, "Adaptive speculation").

The rounds run on rows borrowed from the shared pools before the scheduler starts; everything is returned.
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from treepage.core import Req, SamplingParams
from treepage.mem_cache.memory_pool import free_row, grow_row
from treepage.mem_cache.sizing import alloc_len_for_shape
from treepage.server_args import ServerArgs
from treepage.speculative.adaptive import (
    OFF,
    ONE_DRAFT,
    CostTable,
    TreeShape,
    cache_key,
    default_cache_path,
    load_table,
    maximal_shapes,
    on_segment,
    save_table,
    weights_fingerprint,
)
from treepage.speculative.eagle_worker import EagleWorker, SpecDebugCounters

logger = logging.getLogger(__name__)

CALIBRATION_VERSION = 7  # part of the cache key: a change to what is measured invalidates old tables
# Timed in this order while the budget lasts: the ends of the range first, then the points between. With batch 1
# alone the table could only scale it linearly, and a batch-16 round costs far less than 16 batch-1 rounds.
BATCH_SIZES = (1, 4, 16, 2, 8)
TIMED_ROUNDS = 2  # per (batch, shape); the fastest is kept (the least disturbed by other processes); served
# rounds correct the table online (AdaptivePolicy.seconds). One warm-up round before them at the first batch size
# only: later sizes run warm code, and a first round slowed by a new tensor shape is one of two, not the minimum.
ACCEPT_PASSES = 8  # rounds of every shape in the accept measurement (one row per calibration prompt)
MIN_ACCEPT_PASSES = 2  # the accept measurement stops at its share of the budget, but not before this many
ACCEPT_BUDGET_SHARE = 0.25  # of the budget; the rest times rounds (priors are corrected online, times less so)
CPU_BUDGET_S = 20.0
CUDA_BUDGET_S = 10.0


def device_name(device: torch.device) -> str:
    """What the timings depend on: the accelerator, or the CPU model, its ISA level and the thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} / {torch.backends.cpu.get_cpu_capability()} / {torch.get_num_threads()} threads"


def table_key(worker: EagleWorker, args: ServerArgs, dtype: torch.dtype) -> dict[str, str]:
    shapes = ",".join(s.label for s in worker.shapes)
    extra = f"v{CALIBRATION_VERSION} {args.speculative_algorithm} page={args.page_size} v{args.spec_version} " + (
        f"backend={args.attention_backend} shapes={shapes}"
    )
    return cache_key(
        weights_fingerprint(args.model_path or ""),
        weights_fingerprint(args.speculative_draft_model_path or ""),
        device_name(worker.device),
        str(dtype).replace("torch.", ""),
        torch.__version__,
        extra,
    )


def load_or_calibrate(
    worker: EagleWorker,
    args: ServerArgs,
    dtype: torch.dtype,
    prompts: list[list[int]],
    budget_s: float | None = None,
) -> CostTable:
    """The pinned table (--speculative-adaptive-calibration), else the cached one for this key, else measure."""
    key = table_key(worker, args, dtype)
    shapes = [*worker.shapes, OFF]
    pinned = args.speculative_adaptive_calibration
    path = Path(pinned) if pinned else default_cache_path(key)
    table = load_table(path, None if pinned else key)
    if table is not None and table.covers(shapes):
        logger.info("adaptive speculation: cost table from %s", path)
        return table
    if budget_s is None:
        budget_s = CUDA_BUDGET_S if worker.device.type == "cuda" else CPU_BUDGET_S
    table = calibrate(worker, shapes, prompts, budget_s)
    table.key = key
    try:
        save_table(path, table)
        logger.info("adaptive speculation: cost table written to %s", path)
    except OSError as e:
        logger.warning("adaptive speculation: could not cache the cost table at %s: %s", path, e)
    return table


def calibrate(
    worker: EagleWorker, shapes: list[TreeShape], prompts: list[list[int]], budget_s: float
) -> CostTable:
    """Each shape's mean accept length (`_measure_accept`, within its share of the budget), then seconds per round
    for each shape at the batch sizes of BATCH_SIZES, in that order, while the budget lasts: a batch size is
    skipped when the rounds measured so far predict that it would overrun the budget."""
    t_start = time.perf_counter()
    prior = _measure_accept(worker, shapes, prompts, deadline=t_start + ACCEPT_BUDGET_SHARE * budget_s)
    seconds: dict[str, dict[int, float]] = {s.label: {} for s in shapes}
    cap = worker.pools.req_to_token_pool.num_free()
    for B in [b for b in BATCH_SIZES if b <= cap]:
        first = not seconds[shapes[0].label]
        if not first:
            predicted = TIMED_ROUNDS * sum(_predicted_seconds(seconds[s.label], B) for s in shapes)
            if time.perf_counter() - t_start + predicted > budget_s:
                continue
        measured = _measure_batch(worker, shapes, prompts, B, warm_up=first)
        if measured is None:
            continue  # the pools cannot hold this many rows (a smaller batch later may fit)
        for label, t in measured.items():
            seconds[label][B] = t
    worker.debug = SpecDebugCounters()  # server statistics start after calibration
    if not seconds[shapes[0].label]:
        raise RuntimeError("adaptive speculation: the KV pool cannot hold one calibration request")
    # Sorted and monotone in the batch size: on a shared CPU a slow outlier at a small batch must not make a larger
    # batch look cheaper.
    for label, v in seconds.items():
        running = 0.0
        seconds[label] = {b: (running := max(v[b], running)) for b in sorted(v)}
    logger.info(
        "adaptive speculation calibrated in %.1fs: %s",
        time.perf_counter() - t_start,
        "; ".join(
            f"{label} accept {prior[label]:.2f} "
            + " ".join(f"B{b}={t * 1e3:.0f}ms" for b, t in sorted(v.items()))
            for label, v in seconds.items()
        ),
    )
    return CostTable(seconds, prior)


def _predicted_seconds(measured: dict[int, float], batch: int) -> float:
    """A round's seconds at `batch` for the budget check: on the line between the measured batch sizes around it,
    no cheaper than the smallest, and beyond the largest in proportion to it (pessimistic: a row costs less, not
    more, in a larger batch)."""
    pts = sorted(measured.items())
    (low, t_low), (top, t_top) = pts[0], pts[-1]
    if batch >= top:
        return t_top * batch / top
    return t_low if batch <= low else on_segment(pts, batch)


def _measure_accept(
    worker: EagleWorker, shapes: list[TreeShape], prompts: list[list[int]], deadline: float | None = None
) -> dict[str, float]:
    """Mean tokens per request-round of each shape, paired: only the shapes no other contains are served (one row
    per prompt, in turn), and every shape they contain, ONE_DRAFT included, is read off the same greedy rounds
    (StepOutput.subtree_accept, eagle_verify.subtree_accept_len), so all shapes are measured at the same
    positions. Served one by one, each shape met its own positions (~32 samples each, a standard error ~0.15: two
    shapes of different depth once tied). A greedy continuation is deterministic, so the rounds are many enough
    to spread over the first ~100 tokens of every answer. Passes stop at `deadline` (perf_counter seconds) once
    MIN_ACCEPT_PASSES have run: on a slow machine the timings matter more than a precise prior."""
    spec = [s for s in shapes if not s.is_off]
    served = maximal_shapes(spec)
    passes = ACCEPT_PASSES * len(spec) // len(served)  # as many rounds as serving every shape ACCEPT_PASSES times
    growth = passes * sum(s.steps + 1 for s in served)
    accepts: dict[str, list[float]] = {s.label: [] for s in [*spec, ONE_DRAFT]}
    with borrowed_batch(worker, prompts, len(prompts), growth) as reqs:
        if reqs is None:
            raise RuntimeError("adaptive speculation: the KV pool cannot hold the calibration prompts")
        need = [r.allocated_len for r in reqs]
        for i in range(passes):
            if deadline is not None and i >= MIN_ACCEPT_PASSES and time.perf_counter() > deadline:
                break
            for shape in served:
                for o in worker.run_round(reqs, need, shape):
                    known = o.subtree_accept or {shape.label: len(o.tokens)}
                    for label, a in known.items():
                        accepts[label].append(float(a))
    prior = {label: statistics.fmean(a) for label, a in accepts.items() if a}
    return prior | {s.label: 1.0 for s in shapes if s.is_off}


def _measure_batch(
    worker: EagleWorker, shapes: list[TreeShape], prompts: list[list[int]], B: int, warm_up: bool = True
) -> dict[str, float] | None:
    """Prefill B rows of the prompts, run TIMED_ROUNDS passes over the shapes (after one untimed warm-up pass when
    `warm_up`), OFF last in each pass, and free everything. OFF's one-token draft catch-up lands in the next pass's
    first round, as it would when serving; without the warm-up pass one untimed OFF round comes first, so the
    first timed round pays it too. The fastest timed round of each shape; None when the pools cannot hold the
    batch."""
    order = [s for s in shapes if not s.is_off] + [s for s in shapes if s.is_off]
    lead = order if warm_up else [s for s in order if s.is_off]
    grow = max(s.steps + 1 for s in shapes)
    with borrowed_batch(worker, prompts, B, (len(lead) + len(order) * TIMED_ROUNDS) * grow) as reqs:
        if reqs is None:
            return None
        need = [r.allocated_len for r in reqs]
        for shape in lead:
            worker.run_round(reqs, need, shape)
        times: dict[str, list[float]] = {s.label: [] for s in order}
        for _ in range(TIMED_ROUNDS):  # shapes interleaved: a burst of contention hits all of them
            for shape in order:
                t0 = time.perf_counter()
                worker.run_round(reqs, need, shape)
                worker.sync_device()
                times[shape.label].append(time.perf_counter() - t0)
        return {label: min(t) for label, t in times.items()}


@contextmanager
def borrowed_batch(
    worker: EagleWorker, prompts: list[list[int]], B: int, growth: int
) -> Iterator[list[Req] | None]:
    """B prefilled rows, row i holding prompts[i % len(prompts)], that hold `growth` more tokens plus one round
    of the largest shape; None when the pools cannot hold them. Rows, pages and worker state are returned on
    exit."""
    pools = worker.pools
    P = worker.P
    touch = max(alloc_len_for_shape(P, s.topk, s.steps, s.draft_tokens) for s in worker.shapes)
    reqs: list[Req] = []
    try:
        ok = True
        for i in range(B):
            row = pools.req_to_token_pool.alloc()
            if row is None:
                ok = False
                break
            prompt = prompts[i % len(prompts)]
            need = min(len(prompt) + growth + touch + P, pools.req_to_token_pool.row_width)
            r = Req(f"calibrate-{B}-{i}", list(prompt), SamplingParams(temperature=0.0), sink=lambda _: None)
            r.row = row
            reqs.append(r)
            if not grow_row(pools.req_to_token_pool, pools.allocator, row, 0, need):
                ok = False
                break
            r.allocated_len = need
        if not ok:
            yield None
            return
        worker.prefill(reqs, [len(r.input_ids) for r in reqs])
        yield reqs
    finally:
        worker.release([r.rid for r in reqs])
        for r in reqs:
            if r.allocated_len:
                free_row(pools.req_to_token_pool, pools.allocator, r.row, 0, r.allocated_len)
            pools.req_to_token_pool.free(r.row)
