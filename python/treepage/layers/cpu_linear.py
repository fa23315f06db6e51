"""The bf16 few-row linear kernel for CPU (cpu_linear_bf16.c), built and loaded by cpu_build.py.

It serves the few-row matmuls of decode, draft and small verify steps, where torch's bf16 matmul runs well below
the speed the weights stream from memory (docs/benchmarks_context.md); only where the CPU has AVX512-BF16.
"""

from __future__ import annotations

import ctypes
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


@dataclass(frozen=True)
class Kernel:
    lib: ctypes.CDLL
    amx: bool  # the AMX path serves the shapes it accepts

    def max_rows(self, N: int, K: int) -> int:
        if not self.amx:
            return DPBF16_MAX_ROWS
        return AMX_MAX_ROWS if N % 16 == 0 and K % 32 == 0 else DPBF16_MAX_ROWS_BESIDE_AMX


def _declare(lib: ctypes.CDLL) -> None:
    """A build without AVX512-BF16 holds only linear_bf16_native (which says 0)."""
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.linear_bf16_native.restype = i32
    lib.linear_bf16_native.argtypes = []
    if lib.linear_bf16_native():
        lib.linear_bf16_amx.restype = i32
        lib.linear_bf16_amx.argtypes = []
        lib.linear_bf16.restype = None
        lib.linear_bf16.argtypes = [p, p, p, p, i64, i64, i64, i32]  # x, w, bias, y, M, N, K, nthreads


_kernel: Kernel | None = None
_asked = False


def load() -> Kernel | None:
    """The kernel where it computes natively in bf16, else None."""
    global _kernel, _asked
    if not _asked:
        lib = load_kernel(SOURCE, _declare, "torch's bf16 matmul")
        if lib is not None and lib.linear_bf16_native():
            _kernel = Kernel(lib, bool(lib.linear_bf16_amx()))
        _asked = True
    return _kernel


def max_rows(weight: torch.Tensor) -> int:
    """Input rows up to which the kernel serves this weight here (0: it does not compute on this CPU)."""
    k = load()
    return 0 if k is None else k.max_rows(*weight.shape)


def serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether linear_bf16 can compute F.linear(x, weight, bias): bf16 CPU tensors, few rows, no autograd."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and x.numel() <= max_rows(weight) * x.shape[-1]
    )


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for tensors `serves` accepted: fp32 accumulation, one rounding to bf16."""
    k = load()
    assert k is not None
    N, K = weight.shape
    assert x.shape[-1] == K and (bias is None or bias.shape == (N,))
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.bfloat16)
    k.lib.linear_bf16(
        x2.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
        x2.shape[0], N, K, torch.get_num_threads(),
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], N)
