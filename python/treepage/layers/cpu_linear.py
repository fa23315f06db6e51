"""The bf16 small-row linear kernel for CPU (cpu_linear_bf16.c), built and loaded by cpu_build.py.

It serves the few-row matmuls of decode and draft steps, where torch's bf16 matmul runs well below the speed the
weights stream from memory (docs/benchmarks_context.md); it is used only where the CPU has AVX512-BF16.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from treepage.layers.cpu_build import load_kernel

SOURCE = Path(__file__).with_name("cpu_linear_bf16.c")
# Rows up to which the kernel beats torch's bf16 matmul (per step of a model, 2 threads, on an AMX CPU, where
# torch's matmul is at its best: 2.0x at 1 row, 1.3x at 2, even at 4; benchmarks_context.md).
MAX_ROWS = 2


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.linear_bf16_native.restype = i32
    lib.linear_bf16_native.argtypes = []
    lib.linear_bf16.restype = None
    lib.linear_bf16.argtypes = [p, p, p, p, i64, i64, i64, i32]  # x, w, bias, y, M, N, K, nthreads


_native: bool | None = None  # whether the kernel computes here (None: not asked yet)


def load() -> ctypes.CDLL | None:
    """The kernel library where it computes natively in bf16, else None."""
    global _native
    lib = load_kernel(SOURCE, _declare, "torch's bf16 matmul")
    if lib is None:
        return None
    if _native is None:
        _native = bool(lib.linear_bf16_native())
    return lib if _native else None


def serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether linear_bf16 can compute F.linear(x, weight, bias): bf16 CPU tensors, few rows, no autograd."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.numel() <= MAX_ROWS * x.shape[-1]
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and load() is not None
    )


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for tensors `serves` accepted: fp32 accumulation, one rounding to bf16."""
    lib = load()
    assert lib is not None
    N, K = weight.shape
    assert x.shape[-1] == K and (bias is None or bias.shape == (N,))
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.bfloat16)
    lib.linear_bf16(
        x2.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
        x2.shape[0], N, K, torch.get_num_threads(),
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], N)
