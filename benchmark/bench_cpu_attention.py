"""The CPU paged-attention kernel alone (layers/attention/cpu_paged_attention.c): decode of SmolLM2's heads.

    python benchmark/bench_cpu_attention.py [--contexts 32 2048 4096] [--batches 1 8] [--threads 1]
    git show REV:python/treepage/layers/attention/cpu_paged_attention.c > /tmp/base.c
    python benchmark/bench_cpu_attention.py --baseline /tmp/base.c   # that build and this one, alternating

Per dtype (fp32, bf16), context C and batch B: one layer's decode call (9 query heads, 3 kv heads, head dim 64,
page size 1, consecutive slots), timed two ways:
  - cached: the same layer's K/V again and again (they stay in the caches when they fit: the arithmetic);
  - from memory: --layers distinct layers' K/V in turn, more bytes than the last-level cache holds, as in a model's
    forward, where every layer's K/V and weights pass through between one step's visits to a layer.
The KV bytes a call must read over its time give a rate, printed next to what one torch sum over the same bytes
reaches (the rate memory streams at here). With --baseline, a second build of the kernel from another source
runs in alternation with this one on the same tensors, and the table gives the speed-up. Best of --repeats.
Results: benchmark/results/<--name>.json plus markdown tables.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from common import machine_info, machine_line, print_table, write_results  # noqa: E402

from treepage.layers.attention import cpu_kernels  # noqa: E402
from treepage.layers.cpu_build import load_kernel  # noqa: E402

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def layer_caches(n: int, slots: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(slots, HKV, D, generator=gen).to(dtype),
            torch.randn(slots, HKV, D, generator=gen).to(dtype),
        )
        for _ in range(n)
    ]


def per_call(lib, plan, q, caches, repeats: int, calls: int) -> float:
    """Best over `repeats` of the mean seconds per call, cycling through `caches` for `calls` calls."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            k, v = caches[i % len(caches)]
            cpu_kernels.paged_attention(lib, plan, q, k, v, D**-0.5)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def stream_rate(caches, repeats: int) -> float:
    """Bytes per second one torch sum over every layer's K and V reaches, in turn (best of `repeats`)."""
    total = sum(2 * k.numel() * k.element_size() for k, _ in caches)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, v in caches:
            k.sum()
            v.sum()
        best = min(best, time.perf_counter() - t0)
    return total / best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32, 256, 1024, 2048, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30, help="distinct layers cycled for 'from memory'")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", type=Path, default=None, help="another kernel source to compare against")
    ap.add_argument("--name", default="cpu_attention")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    libs = {"this": cpu_kernels.load()}
    if libs["this"] is None:
        raise SystemExit("the CPU attention kernel cannot be built here (no C compiler?)")
    if args.baseline is not None:
        base = load_kernel(args.baseline.resolve(), cpu_kernels._declare, "nothing")
        if base is None:
            raise SystemExit(f"{args.baseline} does not build")
        libs["baseline"] = base
    info = machine_info()
    print(machine_line(info), f"threads {args.threads}", flush=True)
    rows, results = [], []
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for ctx in args.contexts:
            for B in args.batches:
                slots = B * ctx
                # Enough layers that their bytes exceed the last-level cache several times over.
                n_cold = max(args.layers, -(-128 * 2**20 // (2 * slots * HKV * D * dtype.itemsize)))
                caches = layer_caches(n_cold, slots, dtype)
                table = torch.arange(slots, dtype=torch.int32).view(B, ctx)
                lens = torch.full((B,), ctx)
                plan = cpu_kernels.KernelPlan.build(table, 1, torch.arange(B + 1), lens, lens)
                q = torch.randn(B, HQ, D, generator=torch.Generator().manual_seed(1)).to(dtype)
                kv_bytes = 2 * slots * HKV * D * dtype.itemsize
                calls_hot = max(20, int(2e7 // kv_bytes))
                t = {name: {"cached": [], "memory": []} for name in libs}
                for rnd in range(2):  # alternate the builds, twice each, so that drift hits both alike
                    for name in libs if rnd % 2 == 0 else reversed(list(libs)):
                        lib = libs[name]
                        t[name]["cached"].append(per_call(lib, plan, q, caches[:1], args.repeats, calls_hot))
                        t[name]["memory"].append(per_call(lib, plan, q, caches, args.repeats, n_cold))
                best = {name: {kind: min(v) for kind, v in d.items()} for name, d in t.items()}
                stream = stream_rate(caches, args.repeats)
                this = best["this"]
                row = [dname, ctx, B, f"{kv_bytes / 1e6:.2f}", f"{this['cached'] * 1e6:.1f}",
                       f"{this['memory'] * 1e6:.1f}", f"{kv_bytes / this['memory'] / 1e9:.1f}",
                       f"{stream / 1e9:.1f}"]  # fmt: skip
                entry = {"dtype": dname, "context": ctx, "batch": B, "kv_bytes": kv_bytes,
                         "stream_bytes_per_s": stream, "us": {n: {k: v * 1e6 for k, v in d.items()}
                                                              for n, d in best.items()}}  # fmt: skip
                if "baseline" in best:
                    base = best["baseline"]
                    speed = {k: base[k] / this[k] for k in ("cached", "memory")}
                    row += [f"{base['cached'] * 1e6:.1f}", f"{base['memory'] * 1e6:.1f}",
                            f"{speed['cached']:.2f}", f"{speed['memory']:.2f}"]  # fmt: skip
                    entry["speedup"] = speed
                rows.append(row)
                results.append(entry)
                print(" | ".join(map(str, row)), flush=True)
    headers = ["dtype", "context", "batch", "KV MB", "cached us", "from memory us", "KV GB/s", "stream GB/s"]
    if args.baseline is not None:
        headers += ["baseline cached us", "baseline memory us", "speed-up cached", "speed-up memory"]
    print_table("One layer's decode attention call", headers, rows)
    out = {"machine": info, "threads": args.threads, "baseline": str(args.baseline) if args.baseline else None,
           "results": results}  # fmt: skip
    print("wrote", write_results(args.name, out))
    return out


if __name__ == "__main__":
    main()
