"""Spec v2 (overlap) round preparation: the decode reserve, the row-width invariant and the tail duplication."""

from __future__ import annotations

import torch

from treepage.managers.utils import NARROW_ROWS_ENV, ceil_div, next_alloc_target
from treepage.mem_cache.allocator import PagedAllocator
from treepage.mem_cache.memory_pool import KVPool, ReqToTokenPool, grow_row
from treepage.speculative.draft_layout import DraftLayout, hole_positions


class RowWidthError(RuntimeError):
    """A round would write past the end of a request's req_to_token row (and spill into its neighbour)."""


def duplicate_prefix_tail_to_draft_branches(
    kv_pool: KVPool, req_to_token: torch.Tensor, rows: torch.Tensor, layout: DraftLayout, impl: str = "auto"
) -> None:
    """Copy the draft K/V of the prefix tail into the holes of branches t >= 1, all layers, K and V.

    Each branch then reads its own pages as "tail + chain" with a page-table kernel; the branch's own draft
    slots (offsets >= last_page) are never touched.
    """
    if layout.topk == 1 or layout.page_size == 1:
        return
    if impl == "auto":
        impl = "triton" if kv_pool.kv_data.is_cuda else "torch"
    if impl == "triton":
        from treepage.speculative.triton_ops.tail_dup import tail_dup_triton

        tail_dup_triton(kv_pool.kv_data, req_to_token, rows, layout)
    elif impl == "torch":
        req, src_pos, dst_pos = hole_positions(layout)
        if req.numel() == 0:
            return
        r = rows.to(torch.int64)[req]
        kv_pool.move_kv_cache(req_to_token[r, dst_pos], req_to_token[r, src_pos])
    else:
        raise ValueError(f"unknown impl {impl!r}: expected 'auto', 'triton' or 'torch'")


def check_row_width(
    nxt: list[int] | torch.Tensor,
    row_width: int,
    page_size: int,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
) -> None:
    """The always-on invariant: no round may allocate past the row end (the write would spill and leak)."""
    if isinstance(nxt, torch.Tensor):
        top = int(nxt.max().item()) if nxt.numel() else 0
    else:
        top = max(nxt, default=0)
    if top > row_width:
        raise RowWidthError(
            f"decode reserve needs row length nxt={top} but req_to_token rows are {row_width} wide "
            f"(page_size={page_size}, topk={topk}, num_steps={num_steps}, num_draft_tokens={num_draft_tokens}); "
            f"writing it would spill into the neighbour row and leak KV pages. Rows are sized by "
            f"get_row_width: unset {NARROW_ROWS_ENV} or raise the --context-length headroom."
        )


def reserve_decode_slots(
    req_to_token_pool: ReqToTokenPool,
    allocator: PagedAllocator,
    rows: list[int],
    allocated: list[int],
    committed: list[int],
    reserve: int,
    page_size: int,
    spec_desc: tuple[int, int, int],
) -> list[int] | None:
    """Grow every row to max(allocated, ceil_to_page(committed + reserve)); new allocated lengths, or None.

    The row width is checked for the whole batch before any write, and the page count before any allocation,
    so a refusal leaves nothing half-allocated.
    """
    P = page_size
    nxt = [next_alloc_target(a, c, reserve, P) for a, c in zip(allocated, committed)]
    K, S, N = spec_desc
    check_row_width(nxt, req_to_token_pool.row_width, P, K, S, N)
    need = sum(ceil_div(n, P) - ceil_div(a, P) for a, n in zip(allocated, nxt))
    if need > allocator.num_free_pages():
        return None
    for row, a, n in zip(rows, allocated, nxt):
        ok = grow_row(req_to_token_pool, allocator, row, a, n)
        assert ok, "page count was checked above"
    return nxt
