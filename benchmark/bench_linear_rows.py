"""bf16 decode steps of the default model with the bf16 linear kernel's VDPBF16PS row limit at each given value.

    python benchmark/bench_linear_rows.py [--limits 2 8] [--batches 4 8] [--rounds 4]

bench_linear.py times the matmuls alone; this times whole decode steps (in-process engine, speculation off,
context 32, scheduler stepped on this thread, as bench_context.py does), so a limit that lets the kernel serve a
batch's rows is shown to pay in the step. The limits alternate within each round (the order reversed every
round) on one engine, median step per (limit, batch) over the rounds. Only meaningful on a CPU with
AVX512-BF16 and no AMX, where cpu_linear.DPBF16_MAX_ROWS applies to every shape. Results:
benchmark/results/<--name>.json plus a table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_context import make_engine, treepage_decode  # noqa: E402
from common import ensure_passive_omp, machine_info, machine_line, median, print_table, write_results  # noqa: E402

from treepage.layers import cpu_linear  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limits", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per measurement")
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--name", default="linear_rows_cpu")
    args = ap.parse_args(argv)
    ensure_passive_omp()
    info = machine_info()
    print(machine_line(info))
    kernel = cpu_linear.load()
    if kernel is None or kernel.amx:
        print("note: the kernel's VDPBF16PS limit does not govern this CPU's shapes (no kernel, or AMX)")
    engine = make_engine("bfloat16", args.context + 64, max(args.batches), args.steps)
    default = cpu_linear.DPBF16_MAX_ROWS
    steps: dict[tuple[int, int], list[float]] = {(lim, b): [] for lim in args.limits for b in args.batches}
    try:
        for r in range(args.rounds):
            for lim in args.limits if r % 2 == 0 else args.limits[::-1]:
                cpu_linear.DPBF16_MAX_ROWS = lim
                for b in args.batches:
                    clocks = treepage_decode(engine, args.context, b, args.steps)
                    steps[(lim, b)].append(median([c.wall for c in clocks]))
    finally:
        cpu_linear.DPBF16_MAX_ROWS = default
        engine.shutdown()
    base = args.limits[0]
    table = [
        [
            b,
            lim,
            round(median(steps[(lim, b)]) * 1e3, 1),
            round(median(steps[(base, b)]) / median(steps[(lim, b)]), 3),
        ]
        for b in args.batches
        for lim in args.limits
    ]
    print_table(
        f"bf16 decode step at context {args.context}, ms (median of {args.rounds} rounds' medians)",
        ["batch", "row limit", "ms per step", f"speed-up vs limit {base}"],
        table,
    )
    results = {
        "machine": info,
        "args": vars(args),
        "default_limit": default,
        "step_s": {f"limit{lim}_batch{b}": v for (lim, b), v in steps.items()},
        "table": table,
    }
    print(f"results: {write_results(args.name, results)}")
    return results


if __name__ == "__main__":
    main()
