"""A simple backend: torch SDPA on KV gathered through one page table per query row.

It has no cascade: a draft query reads the shared prefix again for every branch, so routing refuses
topk > 1 with page_size > 1 on it. Useful as a plain-serving baseline and for topk == 1 speculation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treepage.layers.attention.base import AttentionMetadata
from treepage.layers.attention.torch_native_backend import TorchNativeAttnBackend, gather_by_page_table


class SdpaAttnBackend(TorchNativeAttnBackend):
    name = "sdpa"
    supports_paged_tree_draft = False

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scaling: float) -> torch.Tensor:
        P, Lk = meta.page_size, meta.max_kv_len
        k = gather_by_page_table(k_cache, meta.page_table, P, Lk).transpose(1, 2)
        v = gather_by_page_table(v_cache, meta.page_table, P, Lk).transpose(1, 2)
        p = torch.arange(Lk, device=q.device)
        mask = (p[None, :] < meta.kv_lens.long()[:, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(
            q[:, :, None, :], k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scaling, enable_gqa=True
        )
        return o[:, :, 0, :]

    def cascade_draft_decode(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scaling: float
    ) -> torch.Tensor:
        # Without a cascade: one page table per query row = shared pages (page-aligned length) + own pages.
        P, K = meta.page_size, meta.topk
        shared = meta.shared_page_table.repeat_interleave(K, dim=0)
        table = torch.cat([shared, meta.branch_page_table], dim=1)
        shared_lens = meta.shared_lens.long().repeat_interleave(K)
        n_shared_pages = meta.shared_page_table.shape[1]
        # Branch pages start right after the shared width in `table`; map positions accordingly.
        L = table.shape[1] * P
        p = torch.arange(L, device=q.device)
        in_shared = p[None, :] < shared_lens[:, None]
        in_branch = (p[None, :] >= n_shared_pages * P) & (
            p[None, :] - n_shared_pages * P < meta.branch_lens.long()[:, None]
        )
        k = gather_by_page_table(k_cache, table, P, L).transpose(1, 2)
        v = gather_by_page_table(v_cache, table, P, L).transpose(1, 2)
        mask = (in_shared | in_branch)[:, None, None, :]
        o = F.scaled_dot_product_attention(
            q[:, :, None, :], k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scaling, enable_gqa=True
        )
        return o[:, :, 0, :]
