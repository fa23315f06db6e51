"""CPU backend. Decode, tree verify, short extends and the cascade draft decode run in a C kernel that reads K/V
in place through the page table (cpu_kernels); prefill runs SDPA per request. Without the kernel (no C compiler,
fp16, a CUDA tensor) the same modes run in plain torch: K/V gathered by page table, batched and padded."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor

from treepage.layers.attention import cpu_kernels
from treepage.layers.attention.base import AttentionBackend, AttentionMetadata
from treepage.layers.attention.cpu_kernels import MASK_CAUSAL, MASK_TREE, KernelPlan
from treepage.layers.forward_batch import ForwardMode


def gather_by_page_table(cache: Tensor, page_table: Tensor, page_size: int, max_len: int) -> Tensor:
    """cache [slots, H, D] -> [B, max_len, H, D], read through the page table.

    Copies whole pages (P * H * D contiguous elements each) with one index_select: at P > 1 that is a few large
    block copies instead of one small gather per token.
    """
    n_pages = -(-max_len // page_size)
    _, H, D = cache.shape
    pages = cache.view(-1, page_size * H * D).index_select(0, page_table[:, :n_pages].reshape(-1).long())
    return pages.view(page_table.shape[0], n_pages * page_size, H, D)[:, :max_len]


def gather_head_major_fp32(cache: Tensor, page_table: Tensor, page_size: int, max_len: int) -> Tensor:
    """[Hkv, B, max_len, D] fp32 in one copy (gather, then transpose and convert together): batched matmuls
    over (kv head, request) then need no further copy of K or V."""
    kv = gather_by_page_table(cache, page_table, page_size, max_len)
    B, L, H, D = kv.shape
    return torch.empty(H, B, L, D, dtype=torch.float32, device=cache.device).copy_(kv.permute(2, 0, 1, 3))


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
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


def merge_by_lse(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """Merge two partial attentions over disjoint key sets; an empty set has lse = -inf."""
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1 = torch.exp(lse1 - m)
    w2 = torch.exp(lse2 - m)
    denom = (w1 + w2).clamp_min(1e-30)
    return (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / denom.unsqueeze(-1)


def sdpa_on_gathered(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [B, Hq, Lq, D]; k/v gathered [B, Lk, Hkv, D]; mask broadcastable to [B, Hq, Lq, Lk] -> [B, Hq, Lq, D].

    mask None means causal with Lq == Lk: SDPA's causal kernel skips the masked half (a boolean mask costs ~1.4x).
    """
    k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
    if mask is None:
        assert q.shape[2] == k.shape[2], "causal without a mask needs as many queries as keys"
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


# Scores of one batched call stay below this many bytes; larger batches are split into request chunks.
SCORE_BYTES_PER_CALL = 256 << 20
# Extends with at most this many queries per request go to the kernel (a draft extend, a short chunk); longer
# ones are prefills, compute-bound, where SDPA's GEMM-based kernel does better.
KERNEL_MAX_EXTEND = 64


def uniform_visibility_bias(meta: AttentionMetadata, n: int) -> torch.Tensor:
    """[B, n, 1, Lk] fp32, 0 where query j of request b sees position p and -inf elsewhere.

    Request b's queries sit at positions [prefix_b, prefix_b + n): the prefix is visible to all of them, the
    window causally or under the tree mask; positions past the window (table padding) to none.
    """
    assert meta.kv_lens is not None and meta.prefix_lens is not None
    B, Lk = meta.kv_lens.numel(), meta.max_kv_len
    dev = meta.kv_lens.device
    rel = torch.arange(Lk, device=dev)[None, None, :] - meta.prefix_lens.long()[:, None, None]  # [B, 1, Lk]
    if meta.custom_mask is None:
        visible = rel <= torch.arange(n, device=dev)[None, :, None]
    else:
        assert meta.mask_indptr is not None
        flat = meta.mask_indptr[:-1].long()[:, None] + torch.arange(n * n, device=dev)[None, :]
        tree = meta.custom_mask[flat].view(B, n, n)
        in_tree = tree.gather(2, rel.clamp(0, n - 1).expand(B, n, Lk)) & (rel >= 0) & (rel < n)
        visible = (rel < 0) | in_tree
    bias = torch.zeros(B, n, 1, Lk, device=dev)
    return bias.masked_fill_(~visible[:, :, None, :], float("-inf"))


class TorchNativeAttnBackend(AttentionBackend):
    name = "torch_native"
    supports_paged_tree_draft = True
    # False forces the torch path (benchmarks compare the two; tests cover both).
    use_kernel: bool = True

    def kernel_for(self, q: Tensor, k_cache: Tensor) -> ctypes.CDLL | None:
        """The C kernel when it applies to these tensors, else None (the torch path runs)."""
        if not self.use_kernel or q.device.type != "cpu" or k_cache.device.type != "cpu":
            return None
        if q.dtype not in cpu_kernels.KERNEL_DTYPES or k_cache.dtype not in cpu_kernels.KERNEL_DTYPES:
            return None
        return cpu_kernels.load()

    @staticmethod
    def kernel_plan(meta: AttentionMetadata) -> KernelPlan:
        """Extend-like modes (decode, verify, extend) in kernel terms; once per forward, shared by all layers."""
        plan = meta.derived.get("kernel_plan")
        if plan is None:
            table, kv_lens, qo, prefix = meta.page_table, meta.kv_lens, meta.qo_indptr, meta.prefix_lens
            assert table is not None and kv_lens is not None and qo is not None and prefix is not None
            if meta.mode == ForwardMode.DECODE:
                qs = torch.arange(kv_lens.numel() + 1, dtype=torch.int32)
                plan = KernelPlan.build(table, meta.page_size, qs, kv_lens, kv_lens)
            elif meta.custom_mask is not None:
                assert meta.mask_indptr is not None
                plan = KernelPlan.build(
                    table,
                    meta.page_size,
                    qo,
                    kv_lens,
                    prefix,
                    MASK_TREE,
                    meta.custom_mask,
                    meta.mask_indptr[:-1],
                )
            else:
                plan = KernelPlan.build(table, meta.page_size, qo, kv_lens, prefix, MASK_CAUSAL)
            meta.derived["kernel_plan"] = plan
        assert isinstance(plan, KernelPlan)
        return plan

    def extend(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scaling: float,
        new_kv: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Tree verify and short extends in the kernel; prefill per request with SDPA, unpadded. A fresh prompt
        attends to its new K/V as computed (when the pool stores them unconverted, the same values) instead of
        gathering them back out of the pool."""
        lib = self.kernel_for(q, k_cache)
        if lib is not None and (meta.custom_mask is not None or meta.max_q_len <= KERNEL_MAX_EXTEND):
            out, _ = cpu_kernels.paged_attention(lib, self.kernel_plan(meta), q, k_cache, v_cache, scaling)
            return out.to(q.dtype)
        table, kv_lens = meta.page_table, meta.kv_lens
        assert (
            table is not None
            and kv_lens is not None
            and meta.qo_indptr is not None
            and meta.prefix_lens is not None
        )
        if meta.mode == ForwardMode.TARGET_VERIFY and q.shape[0] == kv_lens.numel() * meta.max_q_len:
            return self.attend_uniform(q, k_cache, v_cache, meta, scaling, meta.max_q_len)
        P = meta.page_size
        qo = meta.qo_indptr.tolist()
        prefix = meta.prefix_lens.tolist()
        out = torch.empty_like(q)
        local = new_kv is not None and new_kv[0].dtype == k_cache.dtype and meta.custom_mask is None
        for b in range(len(prefix)):
            s, e = qo[b], qo[b + 1]
            q_len, kv_len = e - s, prefix[b] + e - s
            if local and prefix[b] == 0:
                assert new_kv is not None
                k, v = new_kv[0][None, s:e], new_kv[1][None, s:e]
            else:
                k = gather_by_page_table(k_cache, table[b : b + 1], P, kv_len)
                v = gather_by_page_table(v_cache, table[b : b + 1], P, kv_len)
            mask: Tensor | None
            if meta.custom_mask is None and prefix[b] == 0:
                mask = None  # a fresh prompt: plain causal
            elif meta.custom_mask is None:
                row = torch.arange(q_len, device=q.device)[:, None]
                col = torch.arange(kv_len, device=q.device)[None, :]
                mask = (col <= prefix[b] + row)[None, None]
            else:
                assert meta.mask_indptr is not None
                m0 = int(meta.mask_indptr[b])
                tree = meta.custom_mask[m0 : m0 + q_len * q_len].view(q_len, q_len)
                mask = torch.cat([tree.new_ones(q_len, prefix[b]), tree], dim=1)[None, None]
            out[s:e] = sdpa_on_gathered(q[s:e].transpose(0, 1)[None], k, v, mask, scaling)[0].transpose(0, 1)
        return out

    def decode(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scaling: float
    ) -> Tensor:
        lib = self.kernel_for(q, k_cache)
        if lib is not None:
            out, _ = cpu_kernels.paged_attention(lib, self.kernel_plan(meta), q, k_cache, v_cache, scaling)
            return out.to(q.dtype)
        return self.attend_uniform(q, k_cache, v_cache, meta, scaling, 1)

    def attend_uniform(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scaling: float, n: int
    ) -> Tensor:
        """n queries per request (decode: 1, tree verify: N), all requests in a few batched fp32 matmuls.

        K/V are gathered head-major so that no operand needs a second copy, and the math runs in fp32: on a CPU
        a bf16 batched matmul builds a new kernel whenever the context length changes, which is every step.
        """
        _, Hq, D = q.shape
        assert meta.kv_lens is not None and meta.page_table is not None
        B, Lk = meta.kv_lens.numel(), meta.max_kv_len
        Hkv = k_cache.shape[1]
        G = Hq // Hkv
        if "uniform_bias" not in meta.derived:  # once per forward, shared by every layer
            meta.derived["uniform_bias"] = uniform_visibility_bias(meta, n)
        bias = meta.derived["uniform_bias"]
        out = torch.empty_like(q)
        chunk = max(1, SCORE_BYTES_PER_CALL // (Hkv * n * G * Lk * 4))
        for b0 in range(0, B, chunk):
            b1 = min(B, b0 + chunk)
            Bc = b1 - b0
            table = meta.page_table[b0:b1]
            k = gather_head_major_fp32(k_cache, table, meta.page_size, Lk)
            v = gather_head_major_fp32(v_cache, table, meta.page_size, Lk)
            qh = q[b0 * n : b1 * n].view(Bc, n, Hkv, G, D).permute(2, 0, 1, 3, 4).reshape(Hkv, Bc, n * G, D)
            scores = torch.matmul(qh.float(), k.transpose(-1, -2)).mul_(scaling)
            scores.view(Hkv, Bc, n, G, Lk).add_(bias[b0:b1].unsqueeze(0))
            o = torch.matmul(torch.softmax(scores, dim=-1), v)  # [Hkv, Bc, n * G, D]
            out[b0 * n : b1 * n] = o.view(Hkv, Bc, n, G, D).permute(1, 2, 0, 3, 4).reshape(Bc * n, Hq, D)
        return out

    def cascade_draft_decode(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scaling: float
    ) -> Tensor:
        P, K = meta.page_size, meta.topk
        shared_pt, shared_lens = meta.shared_page_table, meta.shared_lens
        branch_pt, branch_lens = meta.branch_page_table, meta.branch_lens
        assert shared_pt is not None and shared_lens is not None
        assert branch_pt is not None and branch_lens is not None
        BK, Hq, D = q.shape
        B = BK // K
        lib = self.kernel_for(q, k_cache)
        if lib is not None:
            shared, branch = self.cascade_plans(meta, B, K)
            o1, lse1 = cpu_kernels.paged_attention(lib, shared, q, k_cache, v_cache, scaling, with_lse=True)
            o2, lse2 = cpu_kernels.paged_attention(lib, branch, q, k_cache, v_cache, scaling, with_lse=True)
            assert lse1 is not None and lse2 is not None
            return merge_by_lse(o1, lse1, o2, lse2).to(q.dtype)
        # Pass 1: the shared whole prefix pages, read once per request for all K branch queries.
        L1 = shared_pt.shape[1] * P
        k1 = gather_by_page_table(k_cache, shared_pt, P, L1)
        v1 = gather_by_page_table(v_cache, shared_pt, P, L1)
        p1 = torch.arange(L1, device=q.device)
        m1 = (p1[None, :] < shared_lens.long()[:, None])[:, None, :].expand(B, K, L1)
        o1, lse1 = attend(q.view(B, K, Hq, D), k1, v1, m1, scaling)
        # Pass 2: each branch's own pages (duplicated prefix tail + its chain so far).
        L2 = branch_pt.shape[1] * P
        k2 = gather_by_page_table(k_cache, branch_pt, P, L2)
        v2 = gather_by_page_table(v_cache, branch_pt, P, L2)
        p2 = torch.arange(L2, device=q.device)
        m2 = (p2[None, :] < branch_lens.long()[:, None])[:, None, :]
        o2, lse2 = attend(q[:, None], k2, v2, m2, scaling)
        o = merge_by_lse(o1.reshape(BK, Hq, D), lse1.reshape(BK, Hq), o2[:, 0], lse2[:, 0])
        return o.to(q.dtype)

    @staticmethod
    def cascade_plans(meta: AttentionMetadata, B: int, K: int) -> tuple[KernelPlan, KernelPlan]:
        """Pass 1: request b's K branch rows read its shared prefix once; pass 2: each row its own pages."""
        plans = meta.derived.get("cascade_plans")
        if plans is None:
            P = meta.page_size
            assert meta.shared_page_table is not None and meta.shared_lens is not None
            assert meta.branch_page_table is not None and meta.branch_lens is not None
            shared = KernelPlan.build(
                meta.shared_page_table, P, torch.arange(0, B * K + 1, K), meta.shared_lens, meta.shared_lens
            )
            branch = KernelPlan.build(
                meta.branch_page_table, P, torch.arange(B * K + 1), meta.branch_lens, meta.branch_lens
            )
            plans = meta.derived["cascade_plans"] = (shared, branch)
        return plans
