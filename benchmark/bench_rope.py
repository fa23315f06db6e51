"""Prefill and decode of the default model with the rotary embedding in the C kernel (layers/cpu_rope.c) and in
the torch path (layers/rope.py, _rotate), alternating on one engine per dtype.

    python benchmark/bench_rope.py [--dtypes bfloat16 float32] [--lengths 256 1024 2048] [--rounds 4]

In-process engine, speculation off, the scheduler stepped on this thread (as bench_context.py does). The two
paths alternate within each round (the order reversed every round); prefills count their best round, decode
steps (context 32, batch 1 and 8) their median. Besides wall time, the seconds spent inside
RotaryEmbedding.forward over each prefill (all layers) say how much of the difference is the rotation itself. The torch path is selected by making cpu_rope.serves say no. Results:
benchmark/results/<--name>.json plus a table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_context import Timer, make_engine, treepage_decode, treepage_prefill  # noqa: E402
from common import ensure_passive_omp, machine_info, machine_line, median, print_table, write_results  # noqa: E402

from treepage.layers import cpu_rope  # noqa: E402
from treepage.layers.rope import RotaryEmbedding  # noqa: E402

PATHS = ("kernel", "torch")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048], help="prefill lengths")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode batch sizes at context 32")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per measurement")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--name", default="rope_cpu")
    args = ap.parse_args(argv)
    ensure_passive_omp()
    info = machine_info()
    print(machine_line(info))
    if cpu_rope.load() is None:
        raise SystemExit("the rotary kernel cannot be built here (no C compiler)")
    serves = cpu_rope.serves
    # (dtype, what, path) -> per round: (wall seconds, seconds inside RotaryEmbedding.forward)
    samples: dict[tuple[str, str, str], list[tuple[float, float]]] = {}

    def measure(key: tuple[str, str], path: str, run) -> None:
        cpu_rope.serves = serves if path == "kernel" else (lambda x: False)
        timer = Timer(RotaryEmbedding, "forward")
        try:
            wall = run()
        finally:
            timer.remove()
            cpu_rope.serves = serves
        samples.setdefault((*key, path), []).append((wall, timer.seconds))

    for dt in args.dtypes:
        engine = make_engine(dt, max(args.lengths), max(args.batches), args.steps)
        try:
            treepage_prefill(engine, 64)  # warm-up
            for r in range(args.rounds):
                for path in PATHS if r % 2 == 0 else PATHS[::-1]:
                    for n in args.lengths:
                        measure((dt, f"prefill {n}"), path, lambda e=engine, n=n: treepage_prefill(e, n).wall)
                    for b in args.batches:
                        measure(
                            (dt, f"decode b{b}"),
                            path,
                            lambda e=engine, b=b: median(
                                [c.wall for c in treepage_decode(e, 32, b, args.steps)]
                            ),
                        )
        finally:
            engine.shutdown()

    table = []
    for dt in args.dtypes:
        for what in [f"prefill {n}" for n in args.lengths] + [f"decode b{b}" for b in args.batches]:
            pick = min if what.startswith("prefill") else median
            k, t = (pick([w for w, _ in samples[(dt, what, p)]]) for p in PATHS)
            rope = [round(median([s for _, s in samples[(dt, what, p)]]) * 1e3, 1) for p in PATHS]
            if not what.startswith("prefill"):  # the timer also saw the decode batch's untimed prefills
                rope = ["", ""]
            table.append([dt, what, round(k * 1e3, 1), round(t * 1e3, 1), round(t / k, 3), *rope])
    print_table(
        f"ms, kernel vs torch rotary, {args.rounds} rounds alternating (prefill: best; decode: median step)",
        ["dtype", "measurement", "kernel ms", "torch ms", "speed-up", "rope ms (kernel)", "rope ms (torch)"],
        table,
    )
    results = {
        "machine": info,
        "args": vars(args),
        "samples": {" ".join(k): v for k, v in samples.items()},
        "table": table,
    }
    print(f"results: {write_results(args.name, results)}")
    return results


if __name__ == "__main__":
    main()
