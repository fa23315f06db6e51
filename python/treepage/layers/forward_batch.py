"""What a model forward receives (ForwardBatch) and returns (ModelOutput): plain data shared by models and layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from treepage.layers.attention.base import AttentionBackend, AttentionMetadata
    from treepage.mem_cache.memory_pool import KVPool


class ForwardMode(Enum):
    EXTEND = auto()  # new tokens on top of a cached prefix, causal (prefill, draft extend)
    DECODE = auto()  # one new token per request
    TARGET_VERIFY = auto()  # N tree tokens per request, window [L, L+N) masked by the tree
    DRAFT_DECODE = auto()  # K branch queries per request over the holey draft layout (cascade)


class CaptureHidden(Enum):
    NONE = auto()
    LAST = auto()  # final-norm output (EAGLE-1 features)
    AUX = auto()  # residual stream at the inputs of chosen layers (EAGLE-3 features)


class ModelOutput(NamedTuple):
    hidden: torch.Tensor  # [T, H] (a draft head: its recurrent state)
    features: torch.Tensor | None = None  # [T, F] target features for a draft head (capture_hidden != NONE)


@dataclass
class CascadePlan:
    """DRAFT_DECODE read plan, built by speculative/draft_layout.py (which knows the holey layout).

    Query row r = b * topk + t. Pass 1 reads the shared whole-page prefix [0, shared_lens[b]) through
    shared_page_table[b] once per request; pass 2 reads branch r's own positions [0, branch_lens[r]) through
    branch_page_table[r].
    """

    shared_page_table: torch.Tensor  # [B, max_shared_pages] int32
    shared_lens: torch.Tensor  # [B] int32
    branch_page_table: torch.Tensor  # [B*K, max_branch_pages] int32
    branch_lens: torch.Tensor  # [B*K] int32
    topk: int


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
    # Host lists, per request. EXTEND: cached-prefix length and number of new tokens (kv_len = prefix + extend);
    # DECODE: extend == 1, prefix = kv_len - 1; TARGET_VERIFY: prefix = L (committed), extend == N.
    prefix_lens: list[int] | None = None
    extend_lens: list[int] | None = None
    # TARGET_VERIFY: tree mask over the window, [B, N, N] bool (row = query node, col = key node)
    tree_mask: torch.Tensor | None = None
    # DRAFT_DECODE: the cascade read plan of this step
    cascade: CascadePlan | None = None
    # Which token rows need logits (None = all rows).
    logits_indices: torch.Tensor | None = None
    capture_hidden: CaptureHidden = CaptureHidden.NONE
    # Extra model inputs (EAGLE heads: target features / recurrent state, [T, F]).
    input_hidden: torch.Tensor | None = None
    attn_metadata: AttentionMetadata | None = field(default=None, repr=False)
