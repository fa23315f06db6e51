"""The rotary embedding kernel for CPU (cpu_rope.c), built and loaded by cpu_build.py.

It rotates q and k of every layer in one pass each, with exactly the values of rope.py's torch path, where that
path's seven ops per tensor cost a decode step their dispatch and a long prefill their copies
(docs/benchmarks_context.md).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from treepage.layers.cpu_build import load_kernel

SOURCE = Path(__file__).with_name("cpu_rope.c")
DTYPES = (torch.float32, torch.bfloat16)


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.rope_rotate.restype = None
    lib.rope_rotate.argtypes = [
        p, p, i32, i64, i64, i64, i64, i64,  # x, out, bf16, T, H, D, stride_t, stride_h
        p, p, p, i32,  # cos, sin, positions, nthreads
    ]  # fmt: skip


def load() -> ctypes.CDLL | None:
    """The kernel library, or None (logged once) when it cannot be built here."""
    return load_kernel(SOURCE, _declare, "the torch rotary path")


def serves(x: torch.Tensor) -> bool:
    """Whether rotate can take x [T, H, D]: fp32 or bf16 on the CPU, unit stride within a head, no autograd."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and x.dim() == 3
        and x.stride(-1) == 1
        and x.shape[-1] % 2 == 0
        and not (torch.is_grad_enabled() and x.requires_grad)
        and load() is not None
    )


def rotate(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos[positions] + swap_halves(x) * sin[positions] for x that `serves` accepted, as a new contiguous tensor.
    positions: int64 [T], each a row of the fp32 tables cos/sin [max_position, D] (the caller checked the range)."""
    lib = load()
    assert lib is not None
    T, H, D = x.shape
    assert positions.dtype == torch.int64 and positions.is_contiguous() and positions.shape == (T,)
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    assert cos.shape[-1] == D and sin.shape == cos.shape
    out = torch.empty(T, H, D, dtype=x.dtype)
    lib.rope_rotate(
        x.data_ptr(), out.data_ptr(), int(x.dtype == torch.bfloat16), T, H, D, x.stride(0), x.stride(1),
        cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out
