"""Triton attention backend: every read goes through page tables (extend/verify, split-K decode, cascade)."""

from __future__ import annotations

import torch

from treepage.layers.attention.base import AttentionBackend, AttentionMetadata
from treepage.layers.attention.triton_ops.cascade_decode import cascade_decode
from treepage.layers.attention.triton_ops.decode_attention import paged_decode
from treepage.layers.attention.triton_ops.extend_attention import paged_extend


class TritonAttnBackend(AttentionBackend):
    """Runs natively on CUDA; on CPU tensors through the Triton interpreter (slow, for tests)."""

    name = "triton"
    supports_paged_tree_draft = True

    def extend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scaling: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        page_table, qo_indptr, prefix_lens = meta.page_table, meta.qo_indptr, meta.prefix_lens
        assert page_table is not None and qo_indptr is not None and prefix_lens is not None
        return paged_extend(
            q,
            k_cache,
            v_cache,
            page_table,
            qo_indptr,
            prefix_lens,
            meta.page_size,
            scaling,
            max_q_len=meta.max_q_len,
            max_kv_len=meta.max_kv_len,
            custom_mask=meta.custom_mask,
            mask_indptr=meta.mask_indptr,
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scaling: float,
    ) -> torch.Tensor:
        page_table, kv_lens = meta.page_table, meta.kv_lens
        assert page_table is not None and kv_lens is not None
        return paged_decode(
            q,
            k_cache,
            v_cache,
            page_table,
            kv_lens,
            meta.page_size,
            scaling,
            max_kv_len=meta.max_kv_len,
        )

    def cascade_draft_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scaling: float,
    ) -> torch.Tensor:
        shared_pt, shared_lens = meta.shared_page_table, meta.shared_lens
        branch_pt, branch_lens = meta.branch_page_table, meta.branch_lens
        assert shared_pt is not None and shared_lens is not None
        assert branch_pt is not None and branch_lens is not None
        return cascade_decode(
            q,
            k_cache,
            v_cache,
            shared_pt,
            shared_lens,
            branch_pt,
            branch_lens,
            meta.topk,
            meta.page_size,
            scaling,
        )
