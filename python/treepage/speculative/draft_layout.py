"""The holey per-branch draft layout (docs/design.md, "Holey layout"): every formula that writes or reads it
lives here.

Per request: last_page = L mod P, prefix_base = L - last_page, nnp = ceil((last_page + S) / P). Branch t owns
row positions [prefix_base + t*nnp*P, prefix_base + (t+1)*nnp*P), whole pages; its step-s token sits at
prefix_base + t*nnp*P + last_page + s. For t >= 1 the first last_page positions are holes that receive a copy
of the prefix tail, so every branch reads its own pages as "tail + chain". At P == 1 (or K == 1) this is the
contiguous layout L + t*S + s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treepage.layers.forward_batch import CascadePlan
from treepage.mem_cache.memory_pool import KVPool, build_page_table


@dataclass
class DraftLayout:
    page_size: int
    topk: int
    num_steps: int
    seq_lens: torch.Tensor  # [B] committed lengths L
    last_page: torch.Tensor  # [B] L mod P
    prefix_base: torch.Tensor  # [B] L - last_page
    num_new_pages: torch.Tensor  # [B] pages per branch
    max_num_new_pages: int  # host: worst case over any L, so shapes do not depend on the batch
    max_prefix_base: int = 0  # host: max over the batch (width of the shared-prefix page table)

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])


def num_new_pages_max(page_size: int, num_steps: int) -> int:
    """Pages per branch in the worst case (branch starting at in-page offset P - 1)."""
    return -(-(page_size - 1 + num_steps) // page_size)


def compute_draft_layout(
    seq_lens: torch.Tensor, page_size: int, topk: int, num_steps: int, max_seq_len: int | None = None
) -> DraftLayout:
    """`max_seq_len` (host max of seq_lens) avoids a device sync when the caller already knows it."""
    P = page_size
    seq_lens = seq_lens.to(torch.int64)
    last_page = seq_lens % P
    prefix_base = seq_lens - last_page
    nnp = torch.div(last_page + num_steps + P - 1, P, rounding_mode="floor")
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    return DraftLayout(
        page_size=P,
        topk=topk,
        num_steps=num_steps,
        seq_lens=seq_lens,
        last_page=last_page,
        prefix_base=prefix_base,
        num_new_pages=nnp,
        max_num_new_pages=num_new_pages_max(P, num_steps),
        max_prefix_base=max_seq_len // P * P,
    )


def _branch_starts(layout: DraftLayout) -> torch.Tensor:
    """[B, K] first row position of each branch's region."""
    t = torch.arange(layout.topk, device=layout.seq_lens.device, dtype=torch.int64)
    stride = layout.num_new_pages * layout.page_size
    return layout.prefix_base[:, None] + t[None, :] * stride[:, None]


def draft_positions(layout: DraftLayout) -> torch.Tensor:
    """[B, K, S] row position written by branch t at step s."""
    s = torch.arange(layout.num_steps, device=layout.seq_lens.device, dtype=torch.int64)
    return (_branch_starts(layout) + layout.last_page[:, None])[:, :, None] + s


def draft_region_end(layout: DraftLayout) -> torch.Tensor:
    """[B] one past the last row position the round may touch."""
    return layout.prefix_base + layout.topk * layout.num_new_pages * layout.page_size


def hole_positions(layout: DraftLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat (req_index, src_pos, dst_pos) of every hole: src prefix_base + j -> dst branch_start(t) + j, t >= 1."""
    device = layout.seq_lens.device
    B, K, P = layout.batch_size, layout.topk, layout.page_size
    if K == 1 or P == 1 or B == 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty, empty
    j = torch.arange(P - 1, device=device, dtype=torch.int64)  # last_page <= P - 1
    starts = _branch_starts(layout)[:, 1:]  # [B, K-1]
    src = (layout.prefix_base[:, None] + j).unsqueeze(1).expand(B, K - 1, P - 1)
    dst = starts[:, :, None] + j
    req = torch.arange(B, device=device, dtype=torch.int64)[:, None, None].expand(B, K - 1, P - 1)
    keep = (j[None, :] < layout.last_page[:, None]).unsqueeze(1).expand(B, K - 1, P - 1)
    return req[keep], src[keep], dst[keep]


def draft_out_cache_loc(req_to_token: torch.Tensor, rows: torch.Tensor, layout: DraftLayout) -> torch.Tensor:
    """[B, K, S] slots the draft tokens write, gathered through the rows."""
    pos = draft_positions(layout)
    return req_to_token[rows[:, None, None], pos]


def shared_prefix_page_table(
    req_to_token: torch.Tensor, rows: torch.Tensor, layout: DraftLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages of the shared whole-page prefix [0, prefix_base): ([B, max_pages], lens = prefix_base)."""
    table = build_page_table(
        req_to_token, rows, layout.prefix_base, layout.page_size, max_len=layout.max_prefix_base
    )
    return table, layout.prefix_base


def branch_page_table(
    req_to_token: torch.Tensor, rows: torch.Tensor, layout: DraftLayout, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row r = b*K + t: pages of branch t's own region ([B*K, max_nnp]); lens = last_page + step + 1.

    The region starts page-aligned, so local position q of the branch lives at page table[r, q // P].
    Pages past the length are 0 (padding).
    """
    B, K, P = layout.batch_size, layout.topk, layout.page_size
    device = layout.seq_lens.device
    lens = (layout.last_page + step + 1)[:, None].expand(B, K)
    i = torch.arange(layout.max_num_new_pages, device=device, dtype=torch.int64)
    local = i * P
    valid = local[None, None, :] < lens[:, :, None]  # [B, K, max_nnp]
    pos = torch.where(valid, _branch_starts(layout)[:, :, None] + local, 0)
    pages = torch.where(valid, req_to_token[rows[:, None, None], pos] // P, 0)
    return pages.reshape(B * K, -1), lens.reshape(B * K)


def cascade_plan(req_to_token: torch.Tensor, rows: torch.Tensor, layout: DraftLayout, step: int) -> CascadePlan:
    """The attention read plan of draft step `step`: shared prefix pages once per request, then each branch's."""
    shared_pt, shared_lens = shared_prefix_page_table(req_to_token, rows, layout)
    branch_pt, branch_lens = branch_page_table(req_to_token, rows, layout, step)
    return CascadePlan(
        shared_page_table=shared_pt.to(torch.int32),
        shared_lens=shared_lens.to(torch.int32),
        branch_page_table=branch_pt.to(torch.int32),
        branch_lens=branch_lens.to(torch.int32),
        topk=layout.topk,
    )


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
