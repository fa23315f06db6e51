"""One launch that copies the prefix tail into the holes of every draft branch, for every layer, K and V.

Program (i, plane): i enumerates (request, branch t >= 1, block of in-page offsets j), plane enumerates
(K|V, layer). Each program gathers its source and destination slots through the request's row and copies
whole [heads * head_dim] slot vectors. The copy moves raw bits (the pool is viewed as an integer tensor of
the same width), so it is exact for every dtype, bf16 included, also under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from treepage.speculative.draft_layout import DraftLayout

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _tail_dup_kernel(
    kv_ptr,
    r2t_ptr,
    rows_ptr,
    prefix_base_ptr,
    last_page_ptr,
    nnp_ptr,
    r2t_stride,
    plane_stride,
    slot_elems,
    num_branches_m1,
    num_j_blocks,
    PAGE_SIZE: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    jb = pid % num_j_blocks
    bt = pid // num_j_blocks
    t = bt % num_branches_m1 + 1
    b = bt // num_branches_m1

    last_page = tl.load(last_page_ptr + b)
    base = tl.load(prefix_base_ptr + b)
    nnp = tl.load(nnp_ptr + b)
    row = tl.load(rows_ptr + b)

    j = jb * BLOCK_J + tl.arange(0, BLOCK_J)
    jmask = j < last_page
    row_ptr = r2t_ptr + row * r2t_stride
    src = tl.load(row_ptr + base + j, mask=jmask, other=0)
    dst = tl.load(row_ptr + base + t * nnp * PAGE_SIZE + j, mask=jmask, other=0)

    plane_ptr = kv_ptr + plane * plane_stride
    src_ptr = plane_ptr + src[:, None] * slot_elems
    dst_ptr = plane_ptr + dst[:, None] * slot_elems
    for d0 in range(0, slot_elems, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = jmask[:, None] & (d[None, :] < slot_elems)
        x = tl.load(src_ptr + d[None, :], mask=m)
        tl.store(dst_ptr + d[None, :], x, mask=m)


def tail_dup_bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype the pool is viewed as: a raw-bits copy is exact for every float dtype."""
    return _INT_VIEW[dtype.itemsize]


def tail_dup_launch_params(page_size: int, slot_elems: int) -> dict[str, Any]:
    """Constexprs and num_warps of _tail_dup_kernel, shared by the launch and the native-compile check.

    Tiles of BLOCK_J in-page offsets x BLOCK_D slot elements, at most 4096 elements (num_warps is Triton's
    default, spelled out for the check).
    """
    block_j = min(16, triton.next_power_of_2(page_size - 1))
    block_d = min(triton.next_power_of_2(slot_elems), max(16, 4096 // block_j))
    return dict(PAGE_SIZE=page_size, BLOCK_J=block_j, BLOCK_D=block_d, num_warps=4)


def tail_dup_triton(
    kv_data: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor, layout: DraftLayout
) -> None:
    """kv_data: [2, layers, slots, heads, dim] contiguous. No host sync: the grid covers the worst-case tail."""
    B, K, P = layout.batch_size, layout.topk, layout.page_size
    if K == 1 or P == 1 or B == 0:
        return
    if not kv_data.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "tail_dup_triton on CPU tensors needs TRITON_INTERPRET=1 set before importing triton"
        )
    assert kv_data.is_contiguous() and req_to_token.stride(1) == 1
    two, num_layers, num_slots = kv_data.shape[:3]
    slot_elems = kv_data[0, 0, 0].numel()
    bits = kv_data.view(tail_dup_bits_dtype(kv_data.dtype))
    params = tail_dup_launch_params(P, slot_elems)
    num_j_blocks = triton.cdiv(P - 1, params["BLOCK_J"])
    grid = (B * (K - 1) * num_j_blocks, two * num_layers)
    _tail_dup_kernel[grid](
        bits,
        req_to_token,
        rows.to(torch.int64),
        layout.prefix_base,
        layout.last_page,
        layout.num_new_pages,
        req_to_token.stride(0),
        num_slots * slot_elems,
        slot_elems,
        K - 1,
        num_j_blocks,
        **params,
    )
