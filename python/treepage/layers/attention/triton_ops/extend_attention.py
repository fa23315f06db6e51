"""Paged extend attention: new tokens on top of a cached prefix (prefill, draft extend, tree verify).

Query j of request b sees positions [0, prefix_lens[b]) unmasked, and new position prefix_lens[b] + c when
c <= j (causal) or custom_mask[mask_indptr[b] + j * q_len + c] (tree verify). The new K/V are already in
the cache. One program per (query block, request, q head): a prefix loop without masks, then the new tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from treepage.layers.attention.triton_ops import (
    LOG2E,
    check_index,
    check_qkv,
    check_table_width,
    dot_precision,
    native_launch,
)
from treepage.layers.attention.triton_ops.decode_attention import load_kv_tile, online_softmax_step


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    O,
    Table,
    QoIndptr,
    PrefixLens,
    Mask,
    MaskIndptr,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    stride_v0,
    stride_v1,
    stride_o0,
    stride_o1,
    stride_table,
    scale_log2,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CUSTOM_MASK: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP

    q_start = tl.load(QoIndptr + b)
    q_len = tl.load(QoIndptr + b + 1) - q_start
    prefix = tl.load(PrefixLens + b)
    m0 = m_block * BLOCK_M
    active = m0 < q_len  # blocks past this request's queries run no loop and store nothing

    j = m0 + tl.arange(0, BLOCK_M)
    j_ok = j < q_len
    d = tl.arange(0, D)
    tok = (q_start + j).to(tl.int64)
    q = tl.load(Q + tok[:, None] * stride_q0 + h * stride_q1 + d[None, :], mask=j_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    table_row = Table + b.to(tl.int64) * stride_table
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    prefix_end = tl.where(active, prefix, 0)
    for n in range(0, prefix_end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        ok = pos < prefix
        k, v = load_kv_tile(
            K, V, table_row, pos, ok, kvh, stride_k0, stride_k1, stride_v0, stride_v1, PAGE, D
        )
        m_i, l_i, acc = online_softmax_step(q, k, v, ok[None, :], m_i, l_i, acc, scale_log2, PREC)

    if CUSTOM_MASK:
        new_end = q_len
        mask_start = tl.load(MaskIndptr + b).to(tl.int64)
    else:
        new_end = tl.minimum(q_len, m0 + BLOCK_M)  # causal: later keys are invisible to this block
        mask_start = 0
    new_end = tl.where(active, new_end, 0)
    for c0 in range(0, new_end, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)
        c_ok = c < q_len
        k, v = load_kv_tile(
            K, V, table_row, prefix + c, c_ok, kvh, stride_k0, stride_k1, stride_v0, stride_v1, PAGE, D
        )
        both = j_ok[:, None] & c_ok[None, :]
        if CUSTOM_MASK:
            bits = tl.load(Mask + mask_start + j[:, None] * q_len + c[None, :], mask=both, other=0)
            visible = both & (bits != 0)
        else:
            visible = both & (c[None, :] <= j[:, None])
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, PREC)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptr = O + tok[:, None] * stride_o0 + h * stride_o1 + d[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=j_ok[:, None])


def extend_blocks(d: int, dtype: torch.dtype, native: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): smaller tiles for big heads and fp32 so shared memory fits."""
    if not native:
        return 16, 32, 4
    if d >= 256 or dtype == torch.float32:
        return 32, 32, 4
    return 64, 64, 4 if d <= 64 else 8


def extend_launch_params(
    group: int,
    page_size: int,
    d: int,
    dtype: torch.dtype,
    custom_mask: bool,
    native: bool,
    block_m: int | None = None,
    block_n: int | None = None,
) -> dict[str, Any]:
    """Constexprs and num_warps of _extend_kernel, shared by the launch and the native-compile check.

    native=True gives the compiled-GPU choice on any host (native_compile.py builds GPU variants on a CPU).
    """
    bm, bn, warps = extend_blocks(d, dtype, native)
    return dict(
        GROUP=group,
        PAGE=page_size,
        D=d,
        BLOCK_M=block_m or bm,
        BLOCK_N=block_n or bn,
        CUSTOM_MASK=custom_mask,
        PREC=dot_precision(dtype, native),
        UPCAST=not native,
        num_warps=warps,
    )


def paged_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    max_q_len: int,
    max_kv_len: int = -1,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] (T = qo_indptr[-1]) -> o [T, Hq, D]; max_q_len must bound every request's q_len."""
    hq, hkv, d = check_qkv(q, k_cache, v_cache)
    bsz = prefix_lens.numel()
    check_index(prefix_lens, "prefix_lens", (bsz,), q.device)
    check_index(qo_indptr, "qo_indptr", (bsz + 1,), q.device)
    check_index(page_table, "page_table", (bsz, -1), q.device)
    assert page_size >= 1 and page_size & (page_size - 1) == 0, f"page size {page_size} not a power of two"
    if max_kv_len < 0 and prefix_lens.device.type == "cpu" and bsz > 0:
        max_kv_len = int((prefix_lens + qo_indptr[1:] - qo_indptr[:-1]).max())
    check_table_width(page_table, prefix_lens, page_size, "page_table", max_kv_len)
    if q.device.type == "cpu" and bsz > 0:
        assert int(qo_indptr[-1]) == q.shape[0], f"qo_indptr[-1]={int(qo_indptr[-1])} != q rows {q.shape[0]}"
        assert int((qo_indptr[1:] - qo_indptr[:-1]).max()) <= max_q_len, "max_q_len below a request's q_len"
    if custom_mask is not None:
        assert mask_indptr is not None, "custom_mask needs mask_indptr"
        check_index(mask_indptr, "mask_indptr", (bsz + 1,), q.device)
        assert custom_mask.dim() == 1 and custom_mask.is_contiguous(), (
            "custom_mask must be flat and contiguous"
        )
        assert custom_mask.dtype in (torch.bool, torch.uint8), f"custom_mask dtype {custom_mask.dtype}"
        assert custom_mask.device == q.device, "custom_mask on another device"
        if custom_mask.dtype == torch.bool:
            custom_mask = custom_mask.view(torch.uint8)
        if q.device.type == "cpu" and bsz > 0:
            assert int(mask_indptr[-1]) <= custom_mask.numel(), "custom_mask shorter than mask_indptr says"
    out = torch.empty_like(q)
    if bsz == 0 or max_q_len == 0:
        return out
    params = extend_launch_params(
        hq // hkv, page_size, d, q.dtype, custom_mask is not None, native_launch(q.device), block_m, block_n
    )
    grid = (triton.cdiv(max_q_len, params["BLOCK_M"]), bsz, hq)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        qo_indptr,
        prefix_lens,
        custom_mask if custom_mask is not None else qo_indptr,
        mask_indptr if mask_indptr is not None else qo_indptr,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        sm_scale * LOG2E,
        **params,
    )
    return out
