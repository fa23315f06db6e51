"""Decode-round sizing and reservation (docs/design.md, "Memory model"): how much KV a round may touch, how wide
rows are, and growing rows before a round, under the always-on row-width check.

`args` is any object with speculative_algorithm (None or "NONE" = off), page_size, speculative_eagle_topk,
speculative_num_steps, speculative_num_draft_tokens and optionally disable_overlap_schedule and
speculative_shapes. With adaptive speculation a round may use any of speculative_shapes [(S, K, N), ...], and
a request may switch shape between any two rounds, so every size here is the max over them.
"""

from __future__ import annotations

import os
from typing import Any

from treepage.mem_cache.allocator import PagedAllocator
from treepage.mem_cache.memory_pool import ReqToTokenPool, grow_row

NARROW_ROWS_ENV = "TREEPAGE_DEBUG_NARROW_ROWS"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ceil_to_page(x: int, page_size: int) -> int:
    return ceil_div(x, page_size) * page_size


def speculation_enabled(args: Any) -> bool:
    algo = getattr(args, "speculative_algorithm", None)
    return algo is not None and str(algo).upper() != "NONE"


def spec_shapes(args: Any) -> list[tuple[int, int, int]]:
    """Every (steps, topk, draft tokens) a round may use: the resolved candidates, else the configured shape."""
    shapes = list(getattr(args, "speculative_shapes", None) or [])
    configured = (
        int(args.speculative_num_steps),
        int(args.speculative_eagle_topk),
        int(args.speculative_num_draft_tokens),
    )
    return shapes or [configured]


def alloc_len_for_shape(page_size: int, topk: int, num_steps: int, num_draft_tokens: int) -> int:
    """KV length one round of this shape may touch (draft branches or the verify window, whichever is larger)."""
    P, K, S, N = page_size, topk, num_steps, num_draft_tokens
    if P == 1 or K == 1:
        return max(S * K, N)
    # Each branch starts at in-page offset L mod P <= P - 1 and spans whole pages.
    nnp_max = ceil_div(P - 1 + S, P)
    return max(nnp_max * P * K, N)


def get_alloc_len_per_decode(args: Any) -> int:
    """KV length one request may touch in one round: the max over the shapes a round may use (an off round of
    adaptive speculation touches one position, less than any shape)."""
    if not speculation_enabled(args):
        return 1
    P = int(args.page_size)
    return max(alloc_len_for_shape(P, K, S, N) for S, K, N in spec_shapes(args))


def max_shape_desc(args: Any) -> tuple[int, int, int]:
    """(topk, steps, draft tokens), each the max over the shapes, for the row-width error message."""
    if not speculation_enabled(args):
        return (1, 0, 0)
    shapes = spec_shapes(args)
    return (max(k for _, k, _ in shapes), max(s for s, _, _ in shapes), max(n for _, _, n in shapes))


def get_alloc_reserve_per_decode(args: Any, overlap: bool = True) -> int:
    """Beyond the committed length: 2x under overlap (spec v2), since the committed length lags one verify."""
    if not speculation_enabled(args):
        return 1
    overlap = overlap and not getattr(args, "disable_overlap_schedule", False)
    return (2 if overlap else 1) * get_alloc_len_per_decode(args)


def next_alloc_target(allocated: int, committed: int, reserve: int, page_size: int) -> int:
    return max(allocated, ceil_to_page(committed + reserve, page_size))


def get_row_width_extra(args: Any) -> int:
    """Row headroom past context_len: the 2x reserve plus the page round-up of nxt, for v1 and v2 alike."""
    if not speculation_enabled(args):
        return 4
    P = int(args.page_size)
    N = max(n for _, _, n in spec_shapes(args))
    if os.environ.get(NARROW_ROWS_ENV) == "1":
        return 4 + N  # the old, too narrow headroom: reproduces the row overflow on purpose
    return max(4 + N, 2 * get_alloc_len_per_decode(args) + P - 1)


def get_row_width(context_len: int, args: Any) -> int:
    return context_len + get_row_width_extra(args)


class RowWidthError(RuntimeError):
    """A round would write past the end of a request's req_to_token row (and spill into its neighbour)."""


def check_row_width(
    nxt: list[int],
    row_width: int,
    page_size: int,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
) -> None:
    """The always-on invariant: no round may allocate past the row end (the write would spill and leak)."""
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
