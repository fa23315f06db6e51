"""Paged attention kernels: Triton vs torch_native vs SDPA on pre-gathered KV, with achieved bandwidth.

On CUDA: Llama-3-8B-like heads (32 q, 8 kv, D 128), page 64, bf16; decode, tree verify (N 32), prefill and the
cascade draft decode (topk 8). Bandwidth = KV bytes the kernel must read / time, next to a device-to-device copy
measured in the same run (copy counts read + write). Writes benchmark/results/attention_<device>.json.
On CPU (Triton interpreter): one tiny shape per kernel, checked against torch_native, then exit.

    python benchmark/bench_attention.py [--out PATH] [--iters N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from treepage.layers.attention import triton_ops  # noqa: F401  (interpreter without a GPU)
from treepage.layers.attention.base import AttentionMetadata
from treepage.layers.attention.torch_native_backend import TorchNativeAttnBackend
from treepage.layers.attention.triton_backend import TritonAttnBackend
from treepage.layers.forward_batch import ForwardMode


@dataclass
class Cfg:
    hq: int
    hkv: int
    d: int
    page: int
    topk: int
    dtype: torch.dtype
    device: torch.device


@dataclass
class Case:
    kernel: str
    batch: int
    kv_len: int
    q_per_req: int
    run: Callable[[], torch.Tensor]  # the Triton backend call
    native: Callable[[], torch.Tensor]
    sdpa: Callable[[], torch.Tensor]
    kv_bytes: int  # KV the paged kernel has to read (shared prefix counted once per request)
    result: dict = field(default_factory=dict)


class PageHeap:
    """A KV cache with pages handed out in random order (a fragmented pool), page 0 reserved as padding."""

    def __init__(self, cfg: Cfg, num_pages: int, seed: int = 0):
        gen = torch.Generator(device=cfg.device).manual_seed(seed)
        shape = (num_pages * cfg.page, cfg.hkv, cfg.d)
        self.k = torch.randn(shape, generator=gen, device=cfg.device, dtype=torch.float32).to(cfg.dtype)
        self.v = torch.randn(shape, generator=gen, device=cfg.device, dtype=torch.float32).to(cfg.dtype)
        self.order = (
            torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1
        ).tolist()
        self.cfg = cfg

    def take(self, rows: int, length: int) -> torch.Tensor:
        """[rows, ceil(length / P)] int32 table of fresh pages."""
        n = -(-length // self.cfg.page)
        pages, self.order = self.order[: rows * n], self.order[rows * n :]
        assert len(pages) == rows * n, "page heap too small"
        return torch.tensor(pages, dtype=torch.int32, device=self.cfg.device).view(rows, n)

    def gather(self, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense [rows, Hkv, length, D] copies for SDPA."""
        P = self.cfg.page
        pos = torch.arange(length, device=table.device)
        slots = table.long()[:, pos // P] * P + pos % P
        return self.k[slots].transpose(1, 2).contiguous(), self.v[slots].transpose(1, 2).contiguous()


def kv_nbytes(cfg: Cfg, tokens: int) -> int:
    return 2 * tokens * cfg.hkv * cfg.d * torch.finfo(cfg.dtype).bits // 8


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, causal=False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)


def ancestor_mask(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if i:
            m[i] = m[int(torch.randint(i, (1,), generator=gen))]
        m[i, i] = True
    return m


def decode_case(cfg: Cfg, B: int, L: int) -> Case:
    heap = PageHeap(cfg, B * -(-L // cfg.page) + 1)
    table = heap.take(B, L)
    dev = cfg.device
    meta = AttentionMetadata(
        mode=ForwardMode.DECODE,
        page_size=cfg.page,
        page_table=table,
        qo_indptr=torch.arange(B + 1, dtype=torch.int32, device=dev),
        prefix_lens=torch.full((B,), L - 1, dtype=torch.int32, device=dev),
        kv_lens=torch.full((B,), L, dtype=torch.int32, device=dev),
        max_q_len=1,
        max_kv_len=L,
    )
    q = torch.randn(B, cfg.hq, cfg.d, device=dev).to(cfg.dtype)
    kd, vd = heap.gather(table, L)
    qd = q[:, :, None, :]
    s = cfg.d**-0.5
    t, n = TritonAttnBackend(), TorchNativeAttnBackend()
    return Case(
        "decode",
        B,
        L,
        1,
        lambda: t.decode(q, heap.k, heap.v, meta, s),
        lambda: n.decode(q, heap.k, heap.v, meta, s),
        lambda: sdpa(qd, kd, vd),
        kv_nbytes(cfg, B * L),
    )


def extend_case(cfg: Cfg, B: int, prefix: int, q_len: int, tree: bool) -> Case:
    L = prefix + q_len
    heap = PageHeap(cfg, B * -(-L // cfg.page) + 1)
    table = heap.take(B, L)
    dev = cfg.device
    meta = AttentionMetadata(
        mode=ForwardMode.TARGET_VERIFY if tree else ForwardMode.EXTEND,
        page_size=cfg.page,
        page_table=table,
        qo_indptr=torch.arange(0, (B + 1) * q_len, q_len, dtype=torch.int32, device=dev),
        prefix_lens=torch.full((B,), prefix, dtype=torch.int32, device=dev),
        kv_lens=torch.full((B,), L, dtype=torch.int32, device=dev),
        max_q_len=q_len,
        max_kv_len=L,
    )
    window = ancestor_mask(q_len, seed=B) if tree else torch.ones(q_len, q_len, dtype=torch.bool).tril()
    if tree:
        meta.custom_mask = window.reshape(-1).repeat(B).to(dev)
        meta.mask_indptr = torch.arange(
            0, (B + 1) * q_len * q_len, q_len * q_len, dtype=torch.int32, device=dev
        )
    full = torch.cat([torch.ones(q_len, prefix, dtype=torch.bool), window], 1).to(dev)
    q = torch.randn(B * q_len, cfg.hq, cfg.d, device=dev).to(cfg.dtype)
    kd, vd = heap.gather(table, L)
    qd = q.view(B, q_len, cfg.hq, cfg.d).transpose(1, 2)
    s = cfg.d**-0.5
    t, n = TritonAttnBackend(), TorchNativeAttnBackend()
    run_sdpa = (
        (lambda: sdpa(qd, kd, vd, causal=True))
        if prefix == 0 and not tree
        else lambda: sdpa(qd, kd, vd, full)
    )
    return Case(
        "verify" if tree else "extend",
        B,
        L,
        q_len,
        lambda: t.extend(q, heap.k, heap.v, meta, s),
        lambda: n.extend(q, heap.k, heap.v, meta, s),
        run_sdpa,
        kv_nbytes(cfg, B * L),
    )


def cascade_case(cfg: Cfg, B: int, L: int, branch_len: int) -> Case:
    K, P = cfg.topk, cfg.page
    shared = L // P * P
    heap = PageHeap(cfg, B * (shared // P) + B * K * -(-branch_len // P) + 1)
    shared_table = heap.take(B, shared)
    branch_table = heap.take(B * K, branch_len)
    dev = cfg.device
    meta = AttentionMetadata(
        mode=ForwardMode.DRAFT_DECODE,
        page_size=P,
        shared_page_table=shared_table,
        shared_lens=torch.full((B,), shared, dtype=torch.int32, device=dev),
        branch_page_table=branch_table,
        branch_lens=torch.full((B * K,), branch_len, dtype=torch.int32, device=dev),
        topk=K,
    )
    q = torch.randn(B * K, cfg.hq, cfg.d, device=dev).to(cfg.dtype)
    # SDPA baseline: every branch query reads its own dense copy of prefix + branch (no sharing).
    ks, vs = heap.gather(shared_table, shared)
    kb, vb = heap.gather(branch_table, branch_len)
    kd = torch.cat([ks.repeat_interleave(K, 0), kb], 2)
    vd = torch.cat([vs.repeat_interleave(K, 0), vb], 2)
    qd = q[:, :, None, :]
    s = cfg.d**-0.5
    t, n = TritonAttnBackend(), TorchNativeAttnBackend()
    return Case(
        "cascade",
        B,
        shared + branch_len,
        K,
        lambda: t.cascade_draft_decode(q, heap.k, heap.v, meta, s),
        lambda: n.cascade_draft_decode(q, heap.k, heap.v, meta, s),
        lambda: sdpa(qd, kd, vd),
        kv_nbytes(cfg, B * shared + B * K * branch_len),
    )


class Timer:
    """Median of per-call times; on CUDA with events and an L2 flush before each call (cold KV)."""

    def __init__(self, device: torch.device, iters: int):
        self.cuda = device.type == "cuda"
        self.iters = iters
        self.scrub = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> float:
        fn()  # compile / warm up
        times = []
        budget_end = time.perf_counter() + 2.0
        for i in range(self.iters):
            if self.cuda:
                self.scrub.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            if i >= 2 and time.perf_counter() > budget_end:  # slow baselines: a few samples are enough
                break
        return statistics.median(times)  # microseconds


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy GB/s, counting bytes read + written."""
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        b.copy_(a)
    end.record()
    end.synchronize()
    secs = start.elapsed_time(end) / 1e3 / reps
    return 2 * n / secs / 1e9


def guarded(timer: Timer, fn: Callable[[], torch.Tensor]) -> float | None:
    """A baseline that runs out of memory (SDPA's math fallback expands GQA heads) is reported as missing."""
    try:
        return timer(fn)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        print(f"baseline skipped: {str(e).splitlines()[0][:120]}", file=sys.stderr)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def measure(case: Case, timer: Timer, copy_bw: float | None) -> dict:
    out, ref = case.run(), case.native()
    err = (out.float() - ref.float()).abs().max().item()
    t_triton = timer(case.run)
    t_native = guarded(timer, case.native)
    t_sdpa = guarded(timer, case.sdpa)
    gbps = case.kv_bytes / (t_triton * 1e-6) / 1e9
    return {
        "kernel": case.kernel,
        "batch": case.batch,
        "kv_len": case.kv_len,
        "q_per_req": case.q_per_req,
        "triton_us": round(t_triton, 2),
        "torch_native_us": None if t_native is None else round(t_native, 2),
        "sdpa_gathered_us": None if t_sdpa is None else round(t_sdpa, 2),
        "kv_bytes": case.kv_bytes,
        "triton_GBps": round(gbps, 1),
        "frac_of_copy_bw": round(gbps / copy_bw, 3) if copy_bw else None,
        "max_abs_diff_vs_native": err,
    }


def dash(x: float | None) -> str:
    return "-" if x is None else str(x)


def markdown(rows: list[dict]) -> str:
    head = "| kernel | B | kv len | q/req | triton us | native us | sdpa (gathered) us | triton GB/s | of copy BW | diff |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        frac = f"{r['frac_of_copy_bw']:.2f}" if r["frac_of_copy_bw"] is not None else "-"
        lines.append(
            f"| {r['kernel']} | {r['batch']} | {r['kv_len']} | {r['q_per_req']} | {r['triton_us']} | "
            f"{dash(r['torch_native_us'])} | {dash(r['sdpa_gathered_us'])} | {r['triton_GBps']} | {frac} | "
            f"{r['max_abs_diff_vs_native']:.1e} |"
        )
    return "\n".join(lines)


def gpu_cases(cfg: Cfg) -> list[Callable[[], Case]]:
    cases = []
    for B in (1, 16, 64):
        for L in (1024, 4096, 8192):
            cases.append(lambda B=B, L=L: decode_case(cfg, B, L))
            cases.append(lambda B=B, L=L: extend_case(cfg, B, L, 32, tree=True))
            cases.append(lambda B=B, L=L: cascade_case(cfg, B, L, branch_len=cfg.page // 2 + 3))
    cases.append(lambda: extend_case(cfg, 1, 0, 4096, tree=False))
    cases.append(lambda: extend_case(cfg, 4, 4096, 1024, tree=False))
    return cases


def cpu_cases(cfg: Cfg) -> list[Callable[[], Case]]:
    return [
        lambda: decode_case(cfg, 2, 21),
        lambda: extend_case(cfg, 2, 9, 5, tree=False),
        lambda: extend_case(cfg, 2, 8, 6, tree=True),
        lambda: cascade_case(cfg, 2, 12, branch_len=3),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default on CUDA: results/attention_<dev>.json)"
    )
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--max-seconds", type=float, default=150.0, help="stop starting new cases after this")
    args = ap.parse_args()

    if torch.cuda.is_available():
        dev = torch.device("cuda")
        cfg = Cfg(hq=32, hkv=8, d=128, page=64, topk=8, dtype=torch.bfloat16, device=dev)
        name = torch.cuda.get_device_name(dev).lower().replace(" ", "_")
        copy_bw, cases, tol = copy_bandwidth(dev), gpu_cases(cfg), 2e-2
        out = args.out or Path(__file__).parent / "results" / f"attention_{name}.json"
    else:
        dev = torch.device("cpu")
        cfg = Cfg(hq=4, hkv=2, d=16, page=4, topk=2, dtype=torch.float32, device=dev)
        name, copy_bw, cases, tol, out = "cpu", None, cpu_cases(cfg), 1e-4, args.out
        args.iters = min(args.iters, 3)

    timer = Timer(dev, args.iters)
    meta = {
        "device": name,
        "dtype": str(cfg.dtype),
        "hq": cfg.hq,
        "hkv": cfg.hkv,
        "head_dim": cfg.d,
        "page_size": cfg.page,
        "topk": cfg.topk,
        "copy_GBps_read_plus_write": copy_bw,
    }
    rows: list[dict] = []
    errors: list[str] = []

    def save() -> None:  # after every case: a later crash or timeout keeps the rows measured so far
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"config": meta, "results": rows, "errors": errors}, indent=2))

    t_end = time.perf_counter() + args.max_seconds
    for i, make in enumerate(cases):
        if time.perf_counter() > t_end:
            print(f"time budget spent: {len(cases) - i} cases not run", file=sys.stderr)
            break
        try:
            case = make()
            rows.append(measure(case, timer, copy_bw))
            print(
                f"{rows[-1]['kernel']} B={rows[-1]['batch']} L={rows[-1]['kv_len']}: {rows[-1]['triton_us']} us",
                file=sys.stderr,
            )
        except Exception as e:  # one failing kernel must not lose the other cases
            errors.append(f"case {i}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
            traceback.print_exc()
        case = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        save()
    print(markdown(rows))
    if copy_bw:
        print(f"\ndevice-to-device copy: {copy_bw:.0f} GB/s (read + write)")
    bad = [r for r in rows if not r["max_abs_diff_vs_native"] < tol]
    if out is not None:
        print(f"wrote {out}")
    if bad:
        print(f"MISMATCH vs torch_native (tol {tol}): {bad}", file=sys.stderr)
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
