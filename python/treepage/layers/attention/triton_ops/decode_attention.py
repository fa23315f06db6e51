"""Split-K paged decode: partial attention per (sequence, kv head, kv split), then a log-sum-exp merge.

The partial kernel serves plain decode and both cascade passes: a program owns QPB query rows per sequence
(QPB = topk for the cascade's shared pass, 1 otherwise) times all GROUP query heads of one kv head, so each
KV tile is loaded once for QPB * GROUP score rows. Partials are fp32 with the lse in log2 units.
"""

from __future__ import annotations

import functools
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
    next_pow2,
)


@triton.jit
def load_kv_tile(
    K,
    V,
    table_row,
    pos,
    ok,
    kvh,
    stride_k0,
    stride_k1,
    stride_v0,
    stride_v1,
    PAGE: tl.constexpr,
    D: tl.constexpr,
):
    """Gather K/V rows of positions `pos` through one page-table row; masked rows read as zero."""
    page = tl.load(table_row + pos // PAGE, mask=ok, other=0).to(tl.int64)
    slot = page * PAGE + (pos % PAGE)
    d = tl.arange(0, D)
    k = tl.load(K + slot[:, None] * stride_k0 + kvh * stride_k1 + d[None, :], mask=ok[:, None], other=0.0)
    v = tl.load(V + slot[:, None] * stride_v0 + kvh * stride_v1 + d[None, :], mask=ok[:, None], other=0.0)
    return k, v


@triton.jit
def online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, PREC: tl.constexpr):
    """One tile of flash attention in the log2 domain; invisible scores contribute exactly zero."""
    k = k.to(q.dtype)  # no-op unless q was upcast (interpreter)
    v = v.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _decode_partial_kernel(
    Q,
    K,
    V,
    Table,
    Lens,
    PartO,
    PartLse,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    stride_v0,
    stride_v1,
    stride_table,
    stride_po0,
    stride_po1,
    stride_po2,
    stride_pl0,
    stride_pl1,
    scale_log2,
    num_splits,
    split_offset,
    QPB: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    length = tl.load(Lens + seq)
    split_len = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, length)

    rows = tl.arange(0, BLOCK_R)
    row_ok = rows < QPB * GROUP
    q_row = seq * QPB + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    d = tl.arange(0, D)
    q = tl.load(
        Q + q_row[:, None] * stride_q0 + head[:, None] * stride_q1 + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    table_row = Table + seq.to(tl.int64) * stride_table
    m_i = tl.full([BLOCK_R], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for n in range(start, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        ok = pos < end
        k, v = load_kv_tile(
            K, V, table_row, pos, ok, kvh, stride_k0, stride_k1, stride_v0, stride_v1, PAGE, D
        )
        m_i, l_i, acc = online_softmax_step(q, k, v, ok[None, :], m_i, l_i, acc, scale_log2, PREC)

    nonempty = l_i > 0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    s = split_offset + split
    po = PartO + q_row[:, None] * stride_po0 + head[:, None] * stride_po1 + s * stride_po2 + d[None, :]
    tl.store(po, out, mask=row_ok[:, None])
    tl.store(PartLse + q_row * stride_pl0 + head * stride_pl1 + s, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    PartO,
    PartLse,
    O,
    stride_po0,
    stride_po1,
    stride_po2,
    stride_pl0,
    stride_pl1,
    stride_o0,
    stride_o1,
    num_splits,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Combine split partials by their lse weights; all-empty rows give zeros, never NaN."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    lse = tl.load(PartLse + row * stride_pl0 + head * stride_pl1 + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    d = tl.arange(0, D)
    po = PartO + row * stride_po0 + head * stride_po1 + s[:, None] * stride_po2 + d[None, :]
    parts = tl.load(po, mask=s_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(O + row * stride_o0 + head * stride_o1 + d, out.to(O.dtype.element_ty))


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(num_programs: int, max_len: int, device: torch.device) -> int:
    """Enough kv splits to fill the GPU; chunks of at least 256 tokens so the merge stays cheap."""
    if max_len <= 0:
        return 1
    if not native_launch(device):
        return max(1, min(2, triton.cdiv(max_len, 1024)))
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = triton.cdiv(2 * sms, max(1, num_programs))
    return max(1, min(want, triton.cdiv(max_len, 256), 32))


def decode_launch_params(
    queries_per_seq: int,
    group: int,
    page_size: int,
    d: int,
    dtype: torch.dtype,
    native: bool,
    block_n: int | None = None,
) -> dict[str, Any]:
    """Constexprs and num_warps of _decode_partial_kernel, shared by the launch and the native-compile check.

    native=True gives the compiled-GPU choice on any host (native_compile.py builds GPU variants on a CPU).
    """
    block_r = max(16, next_pow2(queries_per_seq * group))
    q_tile = block_r * d
    if block_n is None:
        # 32 in the interpreter (cheap programs); natively 64, except fp32 with a large q tile, which needs up
        # to 213 KB of shared memory at 64 (an A100 has 163 KB)
        block_n = 64 if native and not (dtype == torch.float32 and q_tile >= 64 * 128) else 32
    return dict(
        QPB=queries_per_seq,
        GROUP=group,
        PAGE=page_size,
        D=d,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        PREC=dot_precision(dtype, native),
        UPCAST=not native,
        num_warps=4 if q_tile <= 64 * 128 else 8,
    )


def merge_launch_params(num_splits: int, d: int) -> dict[str, Any]:
    """Constexprs and num_warps of _merge_kernel (num_warps is Triton's default, spelled out for the check)."""
    return dict(D=d, BLOCK_S=max(2, next_pow2(num_splits)), num_warps=4)


def new_partials(
    num_rows: int, hq: int, num_splits: int, d: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs [rows, Hq, splits, D] and their log2-lse [rows, Hq, splits]."""
    part_o = torch.empty(num_rows, hq, num_splits, d, dtype=torch.float32, device=device)
    part_lse = torch.empty(num_rows, hq, num_splits, dtype=torch.float32, device=device)
    return part_o, part_lse


def decode_partial(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    num_splits: int,
    split_offset: int = 0,
    queries_per_seq: int = 1,
    block_n: int | None = None,
    host_max_len: int = -1,
) -> None:
    """Attend q rows [seq * QPB, (seq + 1) * QPB) to positions [0, lens[seq]) of table[seq].

    Writes partial splits [split_offset, split_offset + num_splits) of part_o / part_lse.
    """
    hq, hkv, d = check_qkv(q, k_cache, v_cache)
    group = hq // hkv
    n_seq = lens.numel()
    check_index(lens, "lens", (n_seq,), q.device)
    check_index(table, "page table", (n_seq, -1), q.device)
    check_table_width(table, lens, page_size, "page table", host_max_len)
    assert q.shape[0] == n_seq * queries_per_seq, f"q rows {q.shape[0]} != {n_seq} seqs x {queries_per_seq}"
    assert page_size >= 1 and page_size & (page_size - 1) == 0, f"page size {page_size} not a power of two"
    n_rows = q.shape[0]
    assert part_o.dtype == torch.float32 and part_o.is_contiguous() and part_o.dim() == 4
    assert part_o.shape[:2] == (n_rows, hq) and part_o.shape[3] == d, f"partial out {tuple(part_o.shape)}"
    assert part_lse.dtype == torch.float32 and tuple(part_lse.shape) == tuple(part_o.shape[:3])
    assert 0 <= split_offset and split_offset + num_splits <= part_o.shape[2], "split range outside partials"
    if n_seq == 0:
        return
    if table.shape[1] == 0:  # nothing to read (e.g. no shared prefix); keep a valid pointer for the launch
        table = torch.zeros(n_seq, 1, dtype=torch.int32, device=q.device)
    params = decode_launch_params(
        queries_per_seq, group, page_size, d, q.dtype, native_launch(q.device), block_n
    )
    grid = (n_seq, hkv, num_splits)
    _decode_partial_kernel[grid](
        q,
        k_cache,
        v_cache,
        table,
        lens,
        part_o,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        table.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        sm_scale * LOG2E,
        num_splits,
        split_offset,
        **params,
    )


def merge_partials(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n_rows, hq, n_splits, d = part_o.shape
    assert out.shape == (n_rows, hq, d) and out.stride(2) == 1, f"out {tuple(out.shape)}"
    if n_rows == 0:
        return out
    _merge_kernel[(n_rows, hq)](
        part_o,
        part_lse,
        out,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        n_splits,
        **merge_launch_params(n_splits, d),
    )
    return out


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    num_splits: int | None = None,
    max_kv_len: int = -1,
    block_n: int | None = None,
) -> torch.Tensor:
    """One query per request over positions [0, kv_lens[b]): q [B, Hq, D] -> o [B, Hq, D]."""
    hq, hkv, d = check_qkv(q, k_cache, v_cache)
    bsz = q.shape[0]
    if num_splits is None:
        width = page_table.shape[1] * page_size
        num_splits = default_num_splits(bsz * hkv, max_kv_len if max_kv_len >= 0 else width, q.device)
    part_o, part_lse = new_partials(bsz, hq, num_splits, d, q.device)
    decode_partial(
        q,
        k_cache,
        v_cache,
        page_table,
        kv_lens,
        page_size,
        sm_scale,
        part_o,
        part_lse,
        num_splits,
        block_n=block_n,
        host_max_len=max_kv_len,
    )
    return merge_partials(part_o, part_lse, torch.empty_like(q))
