"""A backend without the cascade: each draft query reads the shared prefix again through its own page table.

Extend and decode are torch_native's (on CPU its paged kernel, else SDPA on KV gathered by page table). Because
the draft decode re-reads the prefix once per branch, routing refuses topk > 1 with page_size > 1 on it.
"""

from __future__ import annotations

import torch

from treepage.layers.attention.base import AttentionMetadata
from treepage.layers.attention.torch_native_backend import (
    TorchNativeAttnBackend,
    gather_by_page_table,
    sdpa_on_gathered,
)


class SdpaAttnBackend(TorchNativeAttnBackend):
    name = "sdpa"
    supports_paged_tree_draft = False

    def cascade_draft_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scaling: float,
    ) -> torch.Tensor:
        # Without a cascade: one page table per query row = shared pages (page-aligned length) + own pages.
        P, K = meta.page_size, meta.topk
        shared_pt, branch_pt, branch_lens = meta.shared_page_table, meta.branch_page_table, meta.branch_lens
        assert shared_pt is not None and meta.shared_lens is not None
        assert branch_pt is not None and branch_lens is not None
        shared = shared_pt.repeat_interleave(K, dim=0)
        table = torch.cat([shared, branch_pt], dim=1)
        shared_lens = meta.shared_lens.long().repeat_interleave(K)
        n_shared_pages = shared_pt.shape[1]
        # Branch pages start right after the shared width in `table`; map positions accordingly.
        L = table.shape[1] * P
        p = torch.arange(L, device=q.device)
        in_shared = p[None, :] < shared_lens[:, None]
        in_branch = (p[None, :] >= n_shared_pages * P) & (
            p[None, :] - n_shared_pages * P < branch_lens.long()[:, None]
        )
        k = gather_by_page_table(k_cache, table, P, L)
        v = gather_by_page_table(v_cache, table, P, L)
        mask = (in_shared | in_branch)[:, None, None, :]
        return sdpa_on_gathered(q[:, :, None, :], k, v, mask, scaling)[:, :, 0, :]
