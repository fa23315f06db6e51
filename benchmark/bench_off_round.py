"""OFF rounds of adaptive speculation: keep the draft in step eagerly (a one-token draft extend after every off
round) or lazily (one extend over all the missed tokens when speculation resumes)? Times the same schedule,
m off rounds then one speculative round, both ways, interleaved, on the default model in one process.

    python benchmark/bench_off_round.py [--batch-sizes 1 4] [--off-runs 1 4 16] [--repeats 5]

Results: benchmark/results/<--name>.json plus a markdown table (min and median milliseconds per off round, the
resuming speculative round included and spread over the m off rounds; the min is the least disturbed by other
processes on a shared CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402
    chat_ids,
    ensure_passive_omp,
    machine_info,
    machine_line,
    median,
    print_table,
    write_results,
)

from treepage.entrypoints.engine import Engine  # noqa: E402
from treepage.server_args import ServerArgs  # noqa: E402
from treepage.speculative.adaptive import OFF  # noqa: E402
from treepage.speculative.calibrate import borrowed_batch  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--off-runs", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default="off_round_sync_cpu")
    args = ap.parse_args(argv)
    ensure_passive_omp()
    # The default server's model, head, dtype and pages; the debug cycle skips calibration (not needed here).
    eng = Engine(ServerArgs(speculative_adaptive=True, speculative_adaptive_debug_cycle=True))
    eng.stop_scheduler()  # the worker is driven directly below: no scheduler may check the borrowed pages
    worker = eng.worker
    spec = worker.shape
    prompt = chat_ids(eng.tokenizer, "Explain how a refrigerator keeps food cold.")
    results: dict = {"machine": machine_info(), "args": vars(args), "shape": spec.label, "dtype": str(eng.dtype)}
    rows, runs = [], {}
    try:
        for B in args.batch_sizes:
            for m in args.off_runs:
                growth = (args.repeats + 1) * 2 * (m + spec.steps + 1)
                with borrowed_batch(worker, [prompt], B, growth) as reqs:
                    assert reqs is not None, "the KV pool cannot hold the batch"
                    alloc = [r.allocated_len for r in reqs]
                    per: dict[str, list[float]] = {"lazy": [], "eager": []}
                    for rep in range(args.repeats + 1):
                        for mode in ("lazy", "eager") if rep % 2 else ("eager", "lazy"):
                            worker.off_draft_sync = mode
                            t0 = time.perf_counter()
                            for _ in range(m):
                                worker.run_round(reqs, alloc, OFF)
                            worker.run_round(reqs, alloc, spec)
                            if rep:  # the first repeat warms up
                                per[mode].append((time.perf_counter() - t0) / m)
                run = {f"{k}_median": median(v) for k, v in per.items()} | {f"{k}_min": min(v) for k, v in per.items()}
                runs[f"B{B}_m{m}"] = run
                row = [B, m]
                for stat in ("min", "median"):
                    lazy, eager = run[f"lazy_{stat}"], run[f"eager_{stat}"]
                    row += [round(lazy * 1e3, 1), round(eager * 1e3, 1), round(eager / lazy, 3)]
                rows.append(row)
    finally:
        worker.off_draft_sync = "lazy"
    results["runs"] = runs
    print(machine_line(results["machine"]))
    print_table(
        f"OFF-round draft sync, {spec.label} resuming, {eng.dtype}, min and median of {args.repeats} (ms per off "
        "round, the resuming speculative round spread over them)",
        ["batch", "off rounds in a row", "lazy min", "eager min", "eager/lazy min", "lazy median", "eager median",
         "eager/lazy median"],
        rows,
    )
    print(f"results: {os.path.relpath(write_results(args.name, results))}")
    return results


if __name__ == "__main__":
    main()
