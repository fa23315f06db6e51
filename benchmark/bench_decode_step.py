"""Decode step time with the fused q/k/v and gate/up projections against the separate ones, in one process.

    python benchmark/bench_decode_step.py [--batch-sizes 1 8] [--rounds 8] [--steps 6]

The plain engine (speculation off, page size 1, bf16) decodes a batch of passages of mixed length (16..400
tokens); its scheduler is stepped on this thread. Blocks of steps alternate between the fused path and the
separate projections (the same weights: fusing made the separate ones views of the fused tensors), so background
load hits both alike. Results: benchmark/results/<--name>.json plus a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402
    ensure_passive_omp,
    machine_info,
    machine_line,
    median,
    passage_ids,
    print_table,
    write_results,
)

from treepage.entrypoints.engine import Engine  # noqa: E402

PROMPT_LENS = [16, 400, 48, 256, 24, 128, 320, 64]


def set_fused(fused: dict, on: bool) -> None:
    """Switch every fused module between its fused tensors and its separate projections."""
    for module, (attr, tensors) in fused.items():
        setattr(module, attr, tensors if on else None)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=8, help="alternations of fused / separate")
    ap.add_argument("--steps", type=int, default=6, help="timed decode steps per block")
    ap.add_argument("--name", default="decode_step_cpu")
    args = ap.parse_args(argv)
    ensure_passive_omp()

    engine = Engine(speculative_algorithm="NONE", page_size=1, dtype="bfloat16", log_level="warning")
    engine.stop_scheduler()  # step the scheduler on this thread
    sched = engine.scheduler
    fused = {}
    for m in sched.worker.runner.model.modules():
        for attr in ("qkv", "gate_up"):
            if getattr(m, attr, None) is not None:
                fused[m] = (attr, getattr(m, attr))
    results: dict = {"machine": machine_info(), "args": vars(args), "fused_modules": len(fused), "runs": {}}
    rows = []
    for bsz in args.batch_sizes:
        budget = 2 * args.rounds * (args.steps + 1) + 8
        sp = engine.make_sampling_params({"max_new_tokens": budget, "temperature": 0.0, "ignore_eos": True})
        reqs = [
            engine.submit(passage_ids(engine.tokenizer, n, offset=i), sp, lambda _: None)
            for i, n in enumerate(PROMPT_LENS[:bsz])
        ]
        while any(not r.output_ids for r in reqs):  # prefills, untimed
            sched.step()
        times: dict[str, list[float]] = {"fused": [], "separate": []}
        for _ in range(args.rounds):
            for mode in ("fused", "separate"):
                set_fused(fused, mode == "fused")
                sched.step()  # one untimed step after the switch
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    sched.step()
                times[mode].append((time.perf_counter() - t0) / args.steps * 1e3)
        set_fused(fused, True)
        while any(r.finished is None for r in reqs):
            sched.step()
        f, s = median(times["fused"]), median(times["separate"])
        results["runs"][str(bsz)] = {"ms_per_step": times, "median_fused": f, "median_separate": s}
        rows.append([bsz, round(f, 1), round(s, 1), round(s / f, 3)])
    results["memory_after"] = {"used_pages": sched.allocator.num_used_pages()}
    print(machine_line(results["machine"]))
    print_table(
        "Decode step, ms (median of blocks), plain engine, page 1, bf16",
        ["batch", "fused", "separate", "separate / fused"],
        rows,
    )
    print(f"results: {write_results(args.name, results)}")
    return results


if __name__ == "__main__":
    main()
