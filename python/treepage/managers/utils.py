"""Allocation sizing for decode rounds (DESIGN section 3): how much KV a round may touch and how wide rows are.

`args` is any object with speculative_algorithm (None or "NONE" = off), page_size, speculative_eagle_topk,
speculative_num_steps, speculative_num_draft_tokens and optionally disable_overlap_schedule.
"""

from __future__ import annotations

import os
from typing import Any

NARROW_ROWS_ENV = "TREEPAGE_DEBUG_NARROW_ROWS"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ceil_to_page(x: int, page_size: int) -> int:
    return ceil_div(x, page_size) * page_size


def speculation_enabled(args: Any) -> bool:
    algo = getattr(args, "speculative_algorithm", None)
    return algo is not None and str(algo).upper() != "NONE"


def _spec(args: Any) -> tuple[int, int, int, int]:
    return (
        int(args.page_size),
        int(args.speculative_eagle_topk),
        int(args.speculative_num_steps),
        int(args.speculative_num_draft_tokens),
    )


def get_alloc_len_per_decode(args: Any) -> int:
    """KV length one request may touch in one round (draft branches or the verify window, whichever is larger)."""
    if not speculation_enabled(args):
        return 1
    P, K, S, N = _spec(args)
    if P == 1 or K == 1:
        return max(S * K, N)
    # Each branch starts at in-page offset L mod P <= P - 1 and spans whole pages.
    nnp_max = ceil_div(P - 1 + S, P)
    return max(nnp_max * P * K, N)


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
    P, _, _, N = _spec(args)
    if os.environ.get(NARROW_ROWS_ENV) == "1":
        return 4 + N  # the old, too narrow headroom: reproduces the row overflow on purpose
    return max(4 + N, 2 * get_alloc_len_per_decode(args) + P - 1)


def get_row_width(context_len: int, args: Any) -> int:
    return context_len + get_row_width_extra(args)
