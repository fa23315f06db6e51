"""Paged-attention Triton kernels (extend/verify, split-K decode, two-pass cascade draft decode).

Every kernel reads KV through a page table: slot = page_table[b, p // P] * P + p % P. Without a GPU the kernels
run under the Triton interpreter on CPU tensors, so it is switched on here, before any kernel is decorated.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HEAD_DIMS = (16, 32, 64, 128, 256)
LOG2E = 1.4426950408889634


def check_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Host checks shared by all kernels; returns (Hq, Hkv, D)."""
    assert q.dim() == 3 and k_cache.dim() == 3 and v_cache.dim() == 3, "q [T,Hq,D], k/v cache [slots,Hkv,D]"
    assert k_cache.shape == v_cache.shape, f"k cache {tuple(k_cache.shape)} != v cache {tuple(v_cache.shape)}"
    _, hq, d = q.shape
    _, hkv, dk = k_cache.shape
    assert d == dk, f"q head_dim {d} != kv head_dim {dk}"
    assert d in HEAD_DIMS, f"head_dim {d} unsupported (need one of {HEAD_DIMS})"
    assert hq % hkv == 0, f"q heads {hq} not a multiple of kv heads {hkv}"
    assert q.dtype == k_cache.dtype == v_cache.dtype, (
        f"dtype mismatch {q.dtype} {k_cache.dtype} {v_cache.dtype}"
    )
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {q.dtype}"
    assert q.device == k_cache.device == v_cache.device, "q and kv cache on different devices"
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1, (
        "head_dim must be contiguous"
    )
    return hq, hkv, d


def check_index(t: torch.Tensor, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    """Index buffers must be int32, contiguous, on the kernel's device and exactly the expected size."""
    assert t is not None, f"{name} is required"
    assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    assert t.is_contiguous(), f"{name} must be contiguous"
    assert t.device == device, f"{name} on {t.device}, kernel on {device}"
    if len(shape) == 2 and shape[1] < 0:
        assert t.dim() == 2 and t.shape[0] == shape[0], f"{name} shape {tuple(t.shape)}, want [{shape[0]}, *]"
    else:
        assert tuple(t.shape) == shape, f"{name} shape {tuple(t.shape)}, want {shape}"


def check_table_width(
    table: torch.Tensor, lens: torch.Tensor, page_size: int, name: str, host_max: int = -1
) -> None:
    """A page table narrower than the longest read is an out-of-bounds gather; check without a device sync.

    host_max < 0 means the host does not know the maximum: it is then checked only for CPU tensors (free).
    """
    if host_max < 0 and lens.device.type == "cpu" and lens.numel() > 0:
        host_max = int(lens.max())
    if host_max >= 0:
        width = table.shape[1] * page_size
        assert host_max <= width, (
            f"{name}: length {host_max} exceeds page table width {table.shape[1]}x{page_size}"
        )


def dot_precision(dtype: torch.dtype, native: bool) -> str:
    """fp32 inputs must not be rounded to tf32 on the GPU (the fp32 path is the exact reference).

    Under the interpreter the kernels upcast q/k/v to fp32 (its bf16 arithmetic is wrong), so always ieee.
    """
    return "ieee" if dtype == torch.float32 or not native else "tf32"


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def native_launch(device: torch.device) -> bool:
    """Compiled GPU launch (vs the interpreter, which also serves CPU tensors): selects tiles and precision.

    The launch-parameter functions take this as `native`, so a tool can ask for the GPU choice on any host.
    """
    return device.type == "cuda" and not interpreting()
