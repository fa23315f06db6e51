"""Reference backend in plain torch. Reads KV by page table, batched and padded (no per-request loops)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treepage.layers.attention.base import AttentionBackend, AttentionMetadata


def slots_by_page_table(page_table: torch.Tensor, page_size: int, max_len: int) -> torch.Tensor:
    """[B, max_len] slots: position p of row b lives at page_table[b, p // P] * P + p % P."""
    pos = torch.arange(max_len, device=page_table.device)
    return page_table.long()[:, pos // page_size] * page_size + (pos % page_size)


def gather_by_page_table(cache: torch.Tensor, page_table: torch.Tensor, page_size: int, max_len: int):
    """cache [slots, H, D] -> [B, max_len, H, D], read through the page table."""
    return cache[slots_by_page_table(page_table, page_size, max_len)]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D], mask [B, Lq, Lk] -> (o [B, Lq, Hq, D] fp32, lse [B, Lq, Hq])."""
    B, Lq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    qf = q.float().view(B, Lq, Hkv, G, D)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.float()) * scale
    scores = scores.masked_fill(~mask[:, None, None, :, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G, Lq]
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(-1e30))
    probs = torch.nan_to_num(probs, nan=0.0)
    o = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float()).reshape(B, Lq, Hq, D)
    lse = lse.permute(0, 3, 1, 2).reshape(B, Lq, Hq)
    return o, lse


def merge_by_lse(o1, lse1, o2, lse2):
    """Merge two partial attentions over disjoint key sets; an empty set has lse = -inf."""
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1 = torch.exp(lse1 - m)
    w2 = torch.exp(lse2 - m)
    denom = (w1 + w2).clamp_min(1e-30)
    return (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / denom.unsqueeze(-1)


def sdpa_on_gathered(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Hq, Lq, D]; k/v gathered [B, Lk, Hkv, D]; mask broadcastable to [B, Hq, Lq, Lk] -> [B, Hq, Lq, D]."""
    k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


class TorchNativeAttnBackend(AttentionBackend):
    name = "torch_native"
    supports_paged_tree_draft = True

    def extend(self, q, k_cache, v_cache, meta: AttentionMetadata, scaling: float) -> torch.Tensor:
        """Per request, unpadded: prefix fully visible, new tokens causal or under the tree mask."""
        P = meta.page_size
        qo = meta.qo_indptr.tolist()
        prefix = meta.prefix_lens.tolist()
        out = torch.empty_like(q)
        for b in range(len(prefix)):
            s, e = qo[b], qo[b + 1]
            q_len, kv_len = e - s, prefix[b] + e - s
            k = gather_by_page_table(k_cache, meta.page_table[b : b + 1], P, kv_len)
            v = gather_by_page_table(v_cache, meta.page_table[b : b + 1], P, kv_len)
            if meta.custom_mask is None:
                row = torch.arange(q_len, device=q.device)[:, None]
                col = torch.arange(kv_len, device=q.device)[None, :]
                mask = col <= prefix[b] + row
            else:
                m0 = int(meta.mask_indptr[b])
                tree = meta.custom_mask[m0 : m0 + q_len * q_len].view(q_len, q_len)
                mask = torch.cat([tree.new_ones(q_len, prefix[b]), tree], dim=1)
            out[s:e] = sdpa_on_gathered(q[s:e].transpose(0, 1)[None], k, v, mask[None, None], scaling)[
                0
            ].transpose(0, 1)
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scaling: float) -> torch.Tensor:
        """Grouped matmuls in the cache dtype (no K/V repeat for GQA), softmax in fp32."""
        if "decode_slots" not in meta.derived:  # once per forward, shared by every layer
            Lk = meta.max_kv_len
            meta.derived["decode_slots"] = slots_by_page_table(meta.page_table, meta.page_size, Lk)
            meta.derived["decode_mask"] = (
                torch.arange(Lk, device=q.device)[None, :] < meta.kv_lens.long()[:, None]
            )
        slots, mask = meta.derived["decode_slots"], meta.derived["decode_mask"]
        B, Hq, D = q.shape
        Hkv = k_cache.shape[1]
        k = k_cache[slots].permute(0, 2, 1, 3).to(q.dtype)  # [B, Hkv, Lk, D]
        v = v_cache[slots].permute(0, 2, 1, 3).to(q.dtype)
        scores = torch.matmul(q.view(B, Hkv, Hq // Hkv, D), k.transpose(-1, -2)).float() * scaling
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, v).reshape(B, Hq, D)

    def cascade_draft_decode(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scaling: float
    ) -> torch.Tensor:
        P, K = meta.page_size, meta.topk
        BK, Hq, D = q.shape
        B = BK // K
        # Pass 1: the shared whole prefix pages, read once per request for all K branch queries.
        L1 = meta.shared_page_table.shape[1] * P
        k1 = gather_by_page_table(k_cache, meta.shared_page_table, P, L1)
        v1 = gather_by_page_table(v_cache, meta.shared_page_table, P, L1)
        p1 = torch.arange(L1, device=q.device)
        m1 = (p1[None, :] < meta.shared_lens.long()[:, None])[:, None, :].expand(B, K, L1)
        o1, lse1 = attend(q.view(B, K, Hq, D), k1, v1, m1, scaling)
        # Pass 2: each branch's own pages (duplicated prefix tail + its chain so far).
        L2 = meta.branch_page_table.shape[1] * P
        k2 = gather_by_page_table(k_cache, meta.branch_page_table, P, L2)
        v2 = gather_by_page_table(v_cache, meta.branch_page_table, P, L2)
        p2 = torch.arange(L2, device=q.device)
        m2 = (p2[None, :] < meta.branch_lens.long()[:, None])[:, None, :]
        o2, lse2 = attend(q[:, None], k2, v2, m2, scaling)
        o = merge_by_lse(o1.reshape(BK, Hq, D), lse1.reshape(BK, Hq), o2[:, 0], lse2[:, 0])
        return o.to(q.dtype)
