"""The C paged-attention kernel for CPU (cpu_paged_attention.c), built and loaded by layers/cpu_build.py.

Why C: torch has no op that reads K/V in place through a page table, so the torch path gathers (and widens to
fp32) the whole context of every layer at every step, which costs several times the bytes the attention needs.
Anything that fails (no compiler, a compile error, an unsupported dtype) leaves the torch path in charge.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

import torch

from treepage.layers.cpu_build import load_kernel

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.paged_attention.restype = i32
    lib.paged_attention.argtypes = [
        p, i32, p, p, i32,  # q, q_bf16, k_cache, v_cache, kv_bf16
        p, i64, i32,  # table, table_stride, page_size
        p, p, p,  # q_start, kv_len, full_len
        i32, p, p,  # mask_kind, mask, mask_start
        i32, i32, i32, i32, f32,  # B, Hq, Hkv, D, scale
        p, p, i32,  # out, lse, nthreads
    ]  # fmt: skip


def load() -> ctypes.CDLL | None:
    """The kernel library, or None (logged once) when it cannot be built here."""
    return load_kernel(SOURCE, _declare, "the torch attention path (gathered K/V)")


KERNEL_DTYPES = (torch.float32, torch.bfloat16)
MASK_ALL, MASK_CAUSAL, MASK_TREE = 0, 1, 2


@dataclass
class KernelPlan:
    """One forward's read plan in the kernel's terms, built once and shared by every layer.

    Request b owns query rows [q_start[b], q_start[b+1]) and KV positions [0, kv_len[b]) through table[b];
    positions below full_len[b] are visible to all its queries, the rest (the window) by `mask_kind`.
    """

    table: torch.Tensor  # [B, W] int32
    page_size: int
    q_start: torch.Tensor  # [B+1] int32
    kv_len: torch.Tensor  # [B] int32
    full_len: torch.Tensor  # [B] int32
    mask_kind: int = MASK_ALL
    mask: torch.Tensor | None = None  # flat bool, request b's [n, n] tree at mask_start[b] (MASK_TREE)
    mask_start: torch.Tensor | None = None  # [B] int64
    # Derived once from the fields above, reused by every layer's call (per-call Python work is a visible share of
    # a short-context decode step): the query row count and the plan's arguments to the C function.
    rows: int = field(init=False)
    c_args: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rows = int(self.q_start[-1])
        self.c_args = (
            _ptr(self.table), self.table.stride(0), self.page_size,
            _ptr(self.q_start), _ptr(self.kv_len), _ptr(self.full_len),
            self.mask_kind, _ptr(self.mask), _ptr(self.mask_start), self.kv_len.numel(),
        )  # fmt: skip

    @classmethod
    def build(
        cls,
        table: torch.Tensor,
        page_size: int,
        q_start: torch.Tensor,
        kv_len: torch.Tensor,
        full_len: torch.Tensor,
        mask_kind: int = MASK_ALL,
        mask: torch.Tensor | None = None,
        mask_start: torch.Tensor | None = None,
    ) -> KernelPlan:
        i32 = [t.to(torch.int32).contiguous() for t in (table, q_start, kv_len, full_len)]
        if mask_kind == MASK_TREE:
            assert mask is not None and mask_start is not None
            mask = mask.to(torch.bool).contiguous()
            mask_start = mask_start.to(torch.int64).contiguous()
        return cls(i32[0], page_size, i32[1], i32[2], i32[3], mask_kind, mask, mask_start)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def paged_attention(
    lib: ctypes.CDLL,
    plan: KernelPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    with_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [rows, Hq, D]; caches [slots, Hkv, D] of one dtype (fp32 or bf16) -> (out [rows, Hq, D] fp32,
    natural-log LSE [rows, Hq] fp32 or None). Rows with nothing visible get out 0 and LSE -inf."""
    rows, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in KERNEL_DTYPES and q.dtype in KERNEL_DTYPES
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2] == D and Hq % Hkv == 0
    # The kernel trusts its indices: a plan for other rows would read out of bounds.
    assert plan.q_start.numel() == plan.kv_len.numel() + 1 and plan.rows == rows
    q = q.contiguous()
    out = torch.empty(rows, Hq, D, dtype=torch.float32)
    lse = torch.empty(rows, Hq, dtype=torch.float32) if with_lse else None
    rc = lib.paged_attention(
        q.data_ptr(), q.dtype == torch.bfloat16, k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.dtype == torch.bfloat16, *plan.c_args, Hq, Hkv, D, scale,
        out.data_ptr(), _ptr(lse), torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise MemoryError("the CPU attention kernel could not allocate its scratch")
    return out, lse
