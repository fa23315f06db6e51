"""The one object a forward pass receives: what to run, where the KV goes, what to read."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from treepage.layers.attention.base import AttentionBackend, AttentionMetadata
    from treepage.mem_cache.memory_pool import KVPool


class ForwardMode(Enum):
    EXTEND = auto()  # new tokens on top of a cached prefix, causal (prefill, draft extend)
    DECODE = auto()  # one new token per request
    TARGET_VERIFY = auto()  # N tree tokens per request, window [L, L+N) masked by the tree
    DRAFT_DECODE = auto()  # K branch queries per request over the holey draft layout (cascade)

    @property
    def is_extend_like(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)


class CaptureHidden(Enum):
    NONE = auto()
    LAST = auto()  # final-norm output (EAGLE-1 features)
    AUX = auto()  # residual stream at the inputs of chosen layers (EAGLE-3 features)


@dataclass
class ForwardBatch:
    """Token-major inputs for one model forward.

    Positions index the request's `req_to_token` row; `out_cache_loc` holds the KV slot each new token writes.
    Readers never use token-level slot lists: backends read KV through page tables built from the rows.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute (RoPE) positions
    out_cache_loc: torch.Tensor  # [T] slots to write new K/V
    req_rows: torch.Tensor  # [B] rows of req_to_token
    req_to_token: torch.Tensor  # [R, W]
    kv_pool: KVPool
    attn_backend: AttentionBackend
    page_size: int
    # EXTEND: per-request cached-prefix length and number of new tokens (kv_len = prefix + extend)
    # DECODE: extend_lens == 1, prefix_lens = kv_len - 1
    # TARGET_VERIFY: prefix_lens = L (committed), extend_lens == N
    prefix_lens: torch.Tensor | None = None  # [B] int64
    extend_lens: torch.Tensor | None = None  # [B] int64
    prefix_lens_cpu: list[int] | None = None
    extend_lens_cpu: list[int] | None = None
    # TARGET_VERIFY: tree mask over the window, [B, N, N] bool (row = query node, col = key node)
    tree_mask: torch.Tensor | None = None
    # DRAFT_DECODE: holey-layout description and the step index
    draft_layout: Any = None  # speculative.draft_layout.DraftLayout
    draft_step: int = 0
    topk: int = 1
    # Which token rows need logits (None = all rows).
    logits_indices: torch.Tensor | None = None
    capture_hidden: CaptureHidden = CaptureHidden.NONE
    # Extra model inputs (EAGLE heads: target features / recurrent state, [T, F]).
    input_hidden: torch.Tensor | None = None
    attn_metadata: AttentionMetadata | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return int(self.req_rows.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
