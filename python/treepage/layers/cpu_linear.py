"""The bf16 few-row linear kernel for CPU (cpu_linear_bf16.c), built and loaded by cpu_build.py, and the way
bf16 linears with more rows run on a CPU without native bf16.

The kernel serves the few-row matmuls of decode, draft and small verify steps, where torch's bf16 matmul runs
well below the speed the weights stream from memory (docs/benchmarks_context.md). Where the CPU has
AVX512-BF16 it computes in bf16 (VDPBF16PS, or AMX tiles); on one without (AVX2 + FMA) it widens each weight
vector to fp32 as it loads it. There torch's bf16 matmul is emulated and falls behind fp32 from about 8 rows on
(4x at 256), so a bf16 linear with more rows than the kernel serves runs as an fp32 matmul on the exactly
widened operands (`widened`).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from treepage.layers.cpu_build import load_kernel

SOURCE = Path(__file__).with_name("cpu_linear_bf16.c")
# Rows up to which the kernel beats torch's bf16 matmul over a whole forward's weights (benchmark/bench_linear.py,
# docs/benchmarks_context.md). On an AMX CPU: its AMX path (N % 16 == 0, K % 32 == 0) up to 24 rows (1.2x at 24;
# at 32, the most its two input tiles hold, it is even with torch), and for other shapes its VDPBF16PS path at
# 1-2 rows only, since torch's matmul runs on AMX there. On a CPU with AVX512-BF16 and no AMX, where torch has no
# AMX either, the VDPBF16PS path up to 8 rows (1.02-1.27x at 1-8 rows, 0.97x at 12).
AMX_MAX_ROWS = 24
DPBF16_MAX_ROWS_BESIDE_AMX = 2
DPBF16_MAX_ROWS = 8
# Without native bf16 (measured with torch, oneDNN and MKL capped at AVX2 on an AVX-512 CPU): from 2 rows,
# where it is 1.16-1.34x torch's bf16 matmul (at one row torch's is 1.1-1.3x faster and keeps it), up to
# 12; from 16 on the fp32 matmul on widened operands (`widened`) is as fast or faster.
WIDEN_MIN_ROWS = 2
WIDEN_MAX_ROWS = 12

PATH_WIDEN, PATH_DPBF16 = 1, 2  # linear_bf16_path(): fp32 FMAs on widened bf16, VDPBF16PS


@dataclass(frozen=True)
class Kernel:
    lib: ctypes.CDLL
    path: int  # PATH_WIDEN or PATH_DPBF16
    amx: bool  # the AMX path serves the shapes it accepts

    def max_rows(self, N: int, K: int) -> int:
        if self.path == PATH_WIDEN:
            return WIDEN_MAX_ROWS
        if not self.amx:
            return DPBF16_MAX_ROWS
        return AMX_MAX_ROWS if N % 16 == 0 and K % 32 == 0 else DPBF16_MAX_ROWS_BESIDE_AMX


def _declare(lib: ctypes.CDLL) -> None:
    """A build with neither AVX512-BF16 nor AVX2 + FMA holds only linear_bf16_path (which says 0)."""
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.linear_bf16_path.restype = i32
    lib.linear_bf16_path.argtypes = []
    if lib.linear_bf16_path():
        lib.linear_bf16_amx.restype = i32
        lib.linear_bf16_amx.argtypes = []
        lib.linear_bf16.restype = i32
        lib.linear_bf16.argtypes = [p, p, p, p, i64, i64, i64, i32]  # x, w, bias, y, M, N, K, nthreads


_kernel: Kernel | None = None
_asked = False


def load() -> Kernel | None:
    """The kernel where this build has a path, else None."""
    global _kernel, _asked
    if not _asked:
        lib = load_kernel(SOURCE, _declare, "torch's bf16 matmul")
        if lib is not None and lib.linear_bf16_path():
            _kernel = Kernel(lib, lib.linear_bf16_path(), bool(lib.linear_bf16_amx()))
        _asked = True
    return _kernel


def bf16_emulated() -> bool:
    """Whether this CPU lacks native bf16 as the kernels are built (no AVX512-BF16 in the build's ISA)."""
    k = load()
    return k is not None and k.path == PATH_WIDEN


def max_rows(weight: torch.Tensor) -> int:
    """Input rows up to which the kernel serves this weight here (0: it does not compute on this CPU)."""
    k = load()
    return 0 if k is None else k.max_rows(*weight.shape)


def _bf16_inference(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """bf16 CPU operands and no autograd: what either path below computes."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """Which of "kernel" (linear_bf16), "widened" or "torch" (F.linear) computes F.linear(x, weight, bias)."""
    if not _bf16_inference(x, weight):
        return "torch"
    emulated = bf16_emulated()
    rows = x.numel() // max(x.shape[-1], 1)
    if emulated and 0 < rows < WIDEN_MIN_ROWS:
        return "torch"
    bias_fits = bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())
    if weight.is_contiguous() and bias_fits and rows <= max_rows(weight):
        return "kernel"
    return "widened" if emulated else "torch"


def serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether linear_bf16 computes F.linear(x, weight, bias): bf16 CPU tensors, the rows it serves, no
    autograd."""
    return route(x, weight, bias) == "kernel"


def linear_bf16(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Kernel | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) for tensors `serves` accepted: fp32 accumulation, one rounding to bf16.
    `kernel`: another build than this CPU's (tests run the widening path on a CPU with AVX512-BF16)."""
    k = kernel or load()
    assert k is not None
    N, K = weight.shape
    assert x.shape[-1] == K and (bias is None or bias.shape == (N,))
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.bfloat16)
    failed = k.lib.linear_bf16(
        x2.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
        x2.shape[0], N, K, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"linear_bf16: no scratch memory for {x2.shape[0]} x {K} input rows")
    return y.reshape(*x.shape[:-1], N)


# Weight elements widened at a time by `widened`: blocks of output columns whose fp32 copy (8 MB) stays in the
# last-level cache for the GEMM that reads it, in one buffer per thread (widening each whole weight into a
# fresh tensor made a forward's matmuls about twice as slow at 1-64 rows, page faults included).
WIDEN_BLOCK = 1 << 21
_scratch = threading.local()


def _widen_buffer(n: int) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _scratch.buf = torch.empty(max(n, WIDEN_BLOCK))
    return buf[:n]


def widened(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in fp32 on bf16 operands widened exactly, rounded to bf16 once: what a native bf16 matmul
    computes (fp32 accumulation), at the fp32 GEMM's speed plus one widening pass over the weight."""
    N, K = weight.shape
    x32 = x.reshape(-1, K).float()
    step = max(1, WIDEN_BLOCK // K)
    parts = []
    for n0 in range(0, N, step):
        w = weight[n0 : n0 + step]
        w32 = _widen_buffer(w.numel()).view(w.shape).copy_(w)
        if bias is None:
            parts.append(torch.mm(x32, w32.t()))
        else:
            parts.append(torch.addmm(bias[n0 : n0 + step].float(), x32, w32.t()))
    y = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).to(torch.bfloat16)
    return y.reshape(*x.shape[:-1], N)
