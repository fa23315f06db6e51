"""The few-row bf16 linear kernel (layers/cpu_linear_bf16.c) against torch's bf16 matmul, per row count; on a
CPU without native bf16 also against the fp32 matmul on widened operands (cpu_linear.widened) and plain fp32.

    python benchmark/bench_linear.py [--rows 1 2 3 4 6 8 16] [--repeats 9]

One "pass" is every matmul of one forward of the default model (SmolLM2-135M: per layer the fused q/k/v, o,
the fused gate/up and down projection, then the tied head) with random bf16 weights of those shapes, each
layer its own copy so the weights stream from memory as in a real step (270 MB for SmolLM2, more than L2). For
each row count M the two sides alternate, median of --repeats passes. cpu_linear's row limits rest on this:
the kernel serves the row counts where it wins (on an AMX CPU its AMX path, elsewhere its VDPBF16PS path, and
without native bf16 its widening path, up to the rows where `widened` takes over). `ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2` runs the last case on a CPU with AVX-512.
Results: benchmark/results/<--name>.json plus a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import ensure_passive_omp, machine_info, machine_line, median, print_table, write_results  # noqa: E402

from treepage.layers import cpu_linear  # noqa: E402
from treepage.models.loader import default_model_path, load_config  # noqa: E402


def model_shapes() -> tuple[list[tuple[int, int]], int, tuple[int, int]]:
    """(per-layer (N, K) weight shapes, layer count, head shape) of the default model."""
    c = load_config(default_model_path())
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    layer = [
        (qkv, c.hidden_size),
        (c.hidden_size, c.num_attention_heads * c.head_dim),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]
    return layer, c.num_hidden_layers, (c.vocab_size, c.hidden_size)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--name", default="linear_bf16_cpu")
    args = ap.parse_args(argv)
    ensure_passive_omp()
    if cpu_linear.load() is None:
        sys.exit(
            "the bf16 linear kernel does not compute on this CPU (it needs AVX2 + FMA and a C compiler)"
        )
    torch.manual_seed(0)
    layer, n_layers, head = model_shapes()
    weights = [[torch.randn(n, k, dtype=torch.bfloat16) for n, k in layer] for _ in range(n_layers)]
    weights.append([torch.randn(*head, dtype=torch.bfloat16)])
    weight_bytes = sum(w.numel() * w.element_size() for ws in weights for w in ws)
    sides = {"torch": F.linear, "kernel": lambda x, w: cpu_linear.linear_bf16(x, w, None)}
    emulated = cpu_linear.bf16_emulated()
    if emulated:  # the other ways to run these shapes there: widened operands, fp32 weights (twice the bytes)
        fp32 = {id(w): w.float() for ws in weights for w in ws}
        sides["widened"] = lambda x, w: cpu_linear.widened(x, w, None)
        sides["fp32"] = lambda x, w: F.linear(x.float(), fp32[id(w)])

    def one_pass(fn, rows: int) -> float:
        xs = {
            k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {w.shape[1] for ws in weights for w in ws}
        }
        t0 = time.perf_counter()
        for ws in weights:
            for w in ws:
                fn(xs[w.shape[1]], w)
        return time.perf_counter() - t0

    def xs_like(rows: int, w: torch.Tensor) -> torch.Tensor:
        return torch.empty(rows, w.shape[1], dtype=torch.bfloat16)

    info = machine_info()
    kernel = cpu_linear.load()
    results: dict = {
        "machine": info,
        "args": vars(args),
        "weight_bytes": weight_bytes,
        "kernel_amx": bool(kernel and kernel.amx),
        "kernel_path": {cpu_linear.PATH_WIDEN: "widen", cpu_linear.PATH_DPBF16: "dpbf16"}[kernel.path]
        if kernel
        else None,
        "rows": {},
    }
    table = []
    for rows in args.rows:
        times: dict[str, list[float]] = {name: [] for name in sides}
        for fn in sides.values():
            one_pass(fn, rows)  # warm-up
        for _ in range(args.repeats):
            for name, fn in sides.items():
                times[name].append(one_pass(fn, rows))
        ms = {name: median(t) * 1e3 for name, t in times.items()}
        results["rows"][str(rows)] = {"ms_per_pass": ms, "all_s": times}
        gbs = weight_bytes / (ms["kernel"] * 1e-3) / 1e9
        served = all(cpu_linear.serves(xs_like(rows, w), w, None) for ws in weights for w in ws)
        others = [name for name in sides if name not in ("kernel", "fp32")]
        speedup = min(ms[name] for name in others) / ms["kernel"]
        table.append([rows, *(ms[name] for name in sides), speedup, gbs, served])
    print(machine_line(info))
    print_table(
        f"bf16 matmuls of one SmolLM2 forward ({weight_bytes / 1e6:.0f} MB of weights), ms per pass (median)",
        ["rows", *sides, "kernel vs the best bf16 other", "kernel GB/s", "served by the kernel"],
        table,
    )
    print(f"results: {write_results(args.name, results)}")
    return results


if __name__ == "__main__":
    main()
