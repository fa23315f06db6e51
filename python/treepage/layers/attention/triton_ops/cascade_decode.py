"""Two-pass cascade draft decode over the holey per-branch layout (docs/design.md, "Holey layout").

Query row r = b * K + t. Pass 1: one program per (request, kv head, split) reads each page of the shared prefix
[0, shared_lens[b]) once and scores it against all K * group query rows of the request. Pass 2: one program
per (branch, kv head, split) reads the branch's own positions [0, branch_lens[r]). Both passes write splits of
one partial buffer; a single lse merge combines them (an empty shared prefix merges as weight zero).
"""

from __future__ import annotations

from typing import Any

import torch

from treepage.layers.attention.triton_ops import check_index, check_qkv
from treepage.layers.attention.triton_ops.decode_attention import (
    decode_partial,
    default_num_splits,
    merge_partials,
    new_partials,
)


def cascade_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    shared_page_table: torch.Tensor,
    shared_lens: torch.Tensor,
    branch_page_table: torch.Tensor,
    branch_lens: torch.Tensor,
    topk: int,
    page_size: int,
    sm_scale: float,
    shared_splits: int | None = None,
    branch_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q [B*K, Hq, D] -> o [B*K, Hq, D]."""
    hq, hkv, d = check_qkv(q, k_cache, v_cache)
    assert topk >= 1, f"topk {topk} < 1"
    bsz = shared_lens.numel()
    check_index(shared_lens, "shared_lens", (bsz,), q.device)
    check_index(shared_page_table, "shared_page_table", (bsz, -1), q.device)
    check_index(branch_lens, "branch_lens", (bsz * topk,), q.device)
    check_index(branch_page_table, "branch_page_table", (bsz * topk, -1), q.device)
    assert q.shape[0] == bsz * topk, f"q rows {q.shape[0]} != B {bsz} x topk {topk}"
    # Table widths bound the lengths, so split counts need no device sync.
    if shared_splits is None:
        width = shared_page_table.shape[1] * page_size
        shared_splits = default_num_splits(bsz * hkv, width, q.device)
    if branch_splits is None:
        width = branch_page_table.shape[1] * page_size
        branch_splits = default_num_splits(bsz * topk * hkv, width, q.device)
    n_splits = shared_splits + branch_splits
    part_o, part_lse = new_partials(bsz * topk, hq, n_splits, d, q.device)
    common: dict[str, Any] = dict(
        part_o=part_o, part_lse=part_lse, page_size=page_size, sm_scale=sm_scale, block_n=block_n
    )
    decode_partial(
        q,
        k_cache,
        v_cache,
        shared_page_table,
        shared_lens,
        num_splits=shared_splits,
        split_offset=0,
        queries_per_seq=topk,
        **common,
    )
    decode_partial(
        q,
        k_cache,
        v_cache,
        branch_page_table,
        branch_lens,
        num_splits=branch_splits,
        split_offset=shared_splits,
        queries_per_seq=1,
        **common,
    )
    return merge_partials(part_o, part_lse, torch.empty_like(q))
