"""Prefix-tail duplication throughput (triton vs torch reference vs a per-layer index_copy_ baseline), and
the host memory the widened req_to_token rows cost.

    python benchmark/bench_tail_dup.py            # CPU: small batches, no triton (the interpreter is too slow)
    python benchmark/bench_tail_dup.py --device cuda

Pool: 32 layers, 8 KV heads, head_dim 128, fp16; P=64, K=8, S=3. Each request's tail offset last_page is drawn
uniformly from 1..P-1 (seeded). Only the pages the copy touches are allocated (the tail page and each branch's
first page), so the pool fits. `copied_bytes` is the payload written into the holes (all layers, K and V);
`gbps` counts read + write (2 x copied bytes) per second.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
from common import cpu_info

from treepage.mem_cache.allocator import PagedAllocator
from treepage.mem_cache.memory_pool import KVPool, ReqToTokenPool
from treepage.mem_cache.sizing import get_alloc_len_per_decode, get_alloc_reserve_per_decode, get_row_width
from treepage.speculative.draft_layout import (
    compute_draft_layout,
    duplicate_prefix_tail_to_draft_branches,
    hole_positions,
    num_new_pages_max,
)

LAYERS, HEADS, DIM, DTYPE = 32, 8, 128, torch.float16
P, K, S = 64, 8, 3
ROW_CONFIGS = [(64, 8, 3, 16), (64, 8, 5, 32), (4, 8, 5, 64), (1, 8, 5, 32), (16, 1, 3, 4)]


def build(batch: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed + batch)
    last_page = torch.randint(1, P, (batch,), generator=g)
    layout = compute_draft_layout(last_page.to(device), P, K, S)  # L = last_page: prefix_base 0
    nnp_max = num_new_pages_max(P, S)
    alloc = PagedAllocator(batch * K, P, device=device)
    pool = ReqToTokenPool(batch, K * nnp_max * P, device=device)
    offs = torch.arange(P, device=device)
    nnp = layout.num_new_pages.tolist()
    for b in range(batch):
        pages = alloc.alloc_pages(K)
        for t in range(K):
            start = t * nnp[b] * P
            pool.req_to_token[b, start : start + P] = pages[t] * P + offs
    kv = KVPool(alloc.num_slots, LAYERS, HEADS, DIM, DTYPE, device=device)
    kv.kv_data.normal_()
    rows = torch.arange(batch, device=device)
    return kv, pool, rows, layout


def index_copy_baseline(kv: KVPool, src: torch.Tensor, dst: torch.Tensor) -> None:
    """What a naive port does: one index_select + index_copy_ per layer, for K and for V."""
    for layer in range(kv.num_layers):
        for cache in kv.get_kv(layer):
            cache.index_copy_(0, dst, cache.index_select(0, src))


def timed(fn, device: str, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def bench_batch(batch: int, device: str, warmup: int, iters: int) -> dict:
    kv, pool, rows, layout = build(batch, device)
    r2t = pool.req_to_token
    req, src_pos, dst_pos = hole_positions(layout)
    src, dst = r2t[rows[req], src_pos], r2t[rows[req], dst_pos]
    slot_bytes = kv.nbytes // kv.num_slots
    copied = int(req.numel()) * slot_bytes
    impls = {
        "torch": partial(duplicate_prefix_tail_to_draft_branches, kv, r2t, rows, layout, impl="torch"),
        "index_copy": partial(index_copy_baseline, kv, src, dst),
    }
    if device == "cuda":
        impls["triton"] = partial(
            duplicate_prefix_tail_to_draft_branches, kv, r2t, rows, layout, impl="triton"
        )
    row = {"batch": batch, "holes": int(req.numel()), "copied_bytes": copied, "pool_bytes": kv.nbytes}
    for name, fn in impls.items():
        sec = timed(fn, device, warmup, iters)
        row[f"{name}_ms"] = sec * 1e3
        row[f"{name}_gbps"] = 2 * copied / sec / 1e9
    if device == "cuda":  # bit-for-bit agreement on a fresh pool (the copy is idempotent)
        kv_ref = KVPool(kv.num_slots, LAYERS, HEADS, DIM, DTYPE, device=device)
        kv_ref.kv_data.normal_()
        kv.kv_data.copy_(kv_ref.kv_data)
        impls["triton"]()
        duplicate_prefix_tail_to_draft_branches(kv_ref, r2t, rows, layout, impl="torch")
        row["triton_equals_torch"] = bool(
            torch.equal(kv.kv_data.view(torch.int16), kv_ref.kv_data.view(torch.int16))
        )
    return row


def bench_copy(device: str, batches: list[int], max_pool_gb: float) -> list[dict]:
    slot_bytes = 2 * LAYERS * HEADS * DIM * torch.finfo(DTYPE).bits // 8
    warmup, iters = (3, 20) if device == "cuda" else (1, 3)
    results = []
    for batch in batches:
        pool_bytes = (batch * K + 1) * P * slot_bytes
        if pool_bytes > max_pool_gb * 2**30:
            print(f"skip batch {batch}: pool {pool_bytes / 2**30:.1f} GiB > {max_pool_gb} GiB")
            continue
        results.append(bench_batch(batch, device, warmup, iters))
        print(results[-1], flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def row_memory(context_len: int = 8192, requests: int = 1000) -> list[dict]:
    out = []
    for cfg in ROW_CONFIGS:
        args = SimpleNamespace(
            speculative_algorithm="EAGLE3",
            page_size=cfg[0],
            speculative_eagle_topk=cfg[1],
            speculative_num_steps=cfg[2],
            speculative_num_draft_tokens=cfg[3],
        )
        width = get_row_width(context_len, args)
        narrow = context_len + 4 + cfg[3]
        out.append(
            {
                "P,K,S,N": list(cfg),
                "alloc_len": get_alloc_len_per_decode(args),
                "reserve": get_alloc_reserve_per_decode(args),
                "row_width": width,
                "bytes_per_1k_requests": requests * width * 8,
                "narrow_bytes_per_1k_requests": requests * narrow * 8,
                "extra_bytes_per_1k_requests": requests * (width - narrow) * 8,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes")
    ap.add_argument("--max-pool-gb", type=float, default=None)
    a = ap.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    if a.batches:
        batches = [int(x) for x in a.batches.split(",")]
    else:
        batches = [1, 2, 4, 8, 16, 32, 64, 128, 256] if device == "cuda" else [1, 2, 4, 8]
    max_gb = a.max_pool_gb if a.max_pool_gb is not None else (60.0 if device == "cuda" else 1.5)

    copy = bench_copy(device, batches, max_gb)
    mem = row_memory()
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "host": cpu_info(),
        "pool": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "dtype": str(DTYPE)},
        "P": P,
        "K": K,
        "S": S,
    }
    out_dir = Path(__file__).resolve().parent / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"tail_dup_{device}.json"
    path.write_text(json.dumps({"meta": meta, "copy": copy, "row_memory": mem}, indent=2) + "\n")

    names = [n for n in ("triton", "torch", "index_copy") if copy and f"{n}_ms" in copy[0]]
    print(f"\nTail duplication on {meta['device']} (P={P}, K={K}, 32x8x128 fp16; GB/s = read+write)\n")
    print("| batch | holes | copied MiB | " + " | ".join(f"{n} ms | {n} GB/s" for n in names) + " |")
    print("|---" * (3 + 2 * len(names)) + "|")
    for r in copy:
        cells = " | ".join(f"{r[f'{n}_ms']:.3f} | {r[f'{n}_gbps']:.1f}" for n in names)
        print(f"| {r['batch']} | {r['holes']} | {r['copied_bytes'] / 2**20:.1f} | {cells} |")
    print("\nreq_to_token rows at context_len 8192 (int64), per 1k running requests\n")
    print("| P, K, S, N | reserve | row width | MiB / 1k req | narrow MiB | extra MiB |")
    print("|---|---|---|---|---|---|")
    for m in mem:
        print(
            f"| {', '.join(map(str, m['P,K,S,N']))} | {m['reserve']} | {m['row_width']} | "
            f"{m['bytes_per_1k_requests'] / 2**20:.1f} | {m['narrow_bytes_per_1k_requests'] / 2**20:.1f} | "
            f"{m['extra_bytes_per_1k_requests'] / 2**20:.1f} |"
        )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
