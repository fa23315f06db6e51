"""Abstract attention backend. The metadata object is the only place backends differ.

Every backend reads KV by page table at every page size: position p of a request lives in physical page
`page_table[b, p // P]` at in-page offset `p % P` (slot = page * P + p % P). At P == 1 a page table is a slot list.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from treepage.layers.forward_batch import ForwardBatch, ForwardMode
from treepage.mem_cache.memory_pool import build_page_table


@dataclass
class AttentionMetadata:
    """Per-forward read plan shared by all layers.

    Extend-like modes (EXTEND, DECODE, TARGET_VERIFY): request b has q_len = qo_indptr[b+1] - qo_indptr[b]
    queries; its KV is positions [0, kv_lens[b]) read through page_table[b]; the first prefix_lens[b] positions
    are visible to every query; the last q_len positions are the new tokens, masked causally or, when
    `custom_mask` is set, by `custom_mask[mask_indptr[b]:mask_indptr[b+1]].view(q_len, q_len)`.

    DRAFT_DECODE (cascade): query row r = b * topk + t. Pass 1 reads the shared prefix positions
    [0, shared_lens[b]) through shared_page_table[b] once per request for all topk queries; pass 2 reads the
    branch's own positions [0, branch_lens[r]) through branch_page_table[r]; the two are merged by log-sum-exp.
    """

    mode: ForwardMode
    page_size: int
    page_table: torch.Tensor | None = None  # [B, max_pages] int32
    qo_indptr: torch.Tensor | None = None  # [B+1] int32
    prefix_lens: torch.Tensor | None = None  # [B] int32
    kv_lens: torch.Tensor | None = None  # [B] int32
    max_q_len: int = 0
    max_kv_len: int = 0
    custom_mask: torch.Tensor | None = None  # flat bool
    mask_indptr: torch.Tensor | None = None  # [B+1] int32
    shared_page_table: torch.Tensor | None = None  # [B, max_shared_pages] int32
    shared_lens: torch.Tensor | None = None  # [B] int32
    branch_page_table: torch.Tensor | None = None  # [B*K, max_branch_pages] int32
    branch_lens: torch.Tensor | None = None  # [B*K] int32
    topk: int = 1
    # Backend-derived, per-forward values shared by all layers (e.g. slot tables), filled lazily.
    derived: dict = field(default_factory=dict)


def build_attention_metadata(fb: ForwardBatch) -> AttentionMetadata:
    """The common read plan; a backend may derive more (split counts, int32 copies) from it."""
    P = fb.page_size
    if fb.mode == ForwardMode.DRAFT_DECODE:
        plan = fb.cascade
        assert plan is not None, "a draft decode forward needs its cascade plan (speculative/draft_layout.py)"
        return AttentionMetadata(
            mode=fb.mode,
            page_size=P,
            shared_page_table=plan.shared_page_table,
            shared_lens=plan.shared_lens,
            branch_page_table=plan.branch_page_table,
            branch_lens=plan.branch_lens,
            topk=plan.topk,
        )

    prefix_cpu = fb.prefix_lens
    extend_cpu = fb.extend_lens
    assert prefix_cpu is not None and extend_cpu is not None, "extend-like forward needs host lengths"
    kv_cpu = [p + e for p, e in zip(prefix_cpu, extend_cpu)]
    device = fb.input_ids.device
    kv_lens = torch.tensor(kv_cpu, dtype=torch.int64, device=device)
    page_table = build_page_table(fb.req_to_token, fb.req_rows, kv_lens, P, max_len=max(kv_cpu))
    qo = [0]
    for e in extend_cpu:
        qo.append(qo[-1] + e)
    meta = AttentionMetadata(
        mode=fb.mode,
        page_size=P,
        page_table=page_table.to(torch.int32),
        qo_indptr=torch.tensor(qo, dtype=torch.int32, device=device),
        prefix_lens=torch.tensor(prefix_cpu, dtype=torch.int32, device=device),
        kv_lens=kv_lens.to(torch.int32),
        max_q_len=max(extend_cpu),
        max_kv_len=max(kv_cpu),
    )
    if fb.mode == ForwardMode.TARGET_VERIFY:
        assert fb.tree_mask is not None
        B, N, _ = fb.tree_mask.shape
        meta.custom_mask = fb.tree_mask.reshape(-1).to(torch.bool)
        meta.mask_indptr = torch.arange(0, (B + 1) * N * N, N * N, dtype=torch.int32, device=device)
    return meta


class AttentionBackend(ABC):
    """Stores the new K/V of each layer, then attends according to the forward's metadata."""

    name: ClassVar[str]
    # Can run the two-pass cascade draft decode and the tree verify over page tables (topk > 1, page > 1).
    supports_paged_tree_draft: ClassVar[bool] = False

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        fb.attn_metadata = build_attention_metadata(fb)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> o [T, Hq, D]. New K/V are written before reading."""
        fb.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        k_cache, v_cache = fb.kv_pool.get_kv(layer_id)
        meta = fb.attn_metadata
        assert meta is not None, "init_forward_metadata was not called"
        if meta.mode == ForwardMode.DRAFT_DECODE:
            return self.cascade_draft_decode(q, k_cache, v_cache, meta, scaling)
        if meta.mode == ForwardMode.DECODE:
            return self.decode(q, k_cache, v_cache, meta, scaling)
        return self.extend(q, k_cache, v_cache, meta, scaling, new_kv=(k, v))

    @abstractmethod
    def extend(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scaling: float,
        new_kv: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """new_kv: this forward's K/V rows [T, Hkv, D] as the pool just stored them from (token-major, like q). A
        request without a cached prefix may attend to them instead of reading its whole context back out of the
        pool; a backend may ignore them."""

    @abstractmethod
    def decode(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scaling: float
    ) -> Tensor: ...

    @abstractmethod
    def cascade_draft_decode(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scaling: float
    ) -> Tensor: ...
