"""Paged attention vs a dense fp64 reference: the Triton kernels, the torch_native backend, and each other.

On CPU the kernels run under the Triton interpreter (tiny shapes, fp32 and fp16); on a GPU natively
(larger shapes, fp32/fp16/bf16). Caches are NaN everywhere except the positions a request owns, so a kernel
that reads a padding page, a position past a length or another request's page produces NaN and fails.
"""

from __future__ import annotations

import random

import pytest
import torch

from treepage.layers.attention import (
    cpu_kernels,
    torch_native_backend,
    triton_ops,  # noqa: F401  (selects the interpreter without a GPU)
)
from treepage.layers.attention.base import AttentionMetadata
from treepage.layers.attention.torch_native_backend import TorchNativeAttnBackend
from treepage.layers.attention.triton_backend import TritonAttnBackend
from treepage.layers.attention.triton_ops.cascade_decode import cascade_decode
from treepage.layers.attention.triton_ops.decode_attention import paged_decode
from treepage.layers.attention.triton_ops.extend_attention import paged_extend
from treepage.layers.forward_batch import ForwardMode

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
# (kv heads, group, head_dim, max kv len, batch)
SHAPE = (4, 4, 64, 300, 4) if CUDA else (2, 2, 16, 80, 3)
# bf16 on CPU is covered by test_bf16 alone (the interpreter path upcasts to fp32; keeps the CPU run short).
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
PAGES = [1, 4, 16, 64]


def tol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


class PagedCache:
    """K/V caches whose owned positions are random and everything else NaN; pages handed out at random."""

    def __init__(self, num_pages: int, page: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
        self.P, self.rng = page, random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        shape = (num_pages * page, hkv, d)
        self.k = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
        self.v = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
        self.free = list(range(1, num_pages))  # page 0 is the padding page
        self.rng.shuffle(self.free)

    def table(self, lens: list[int], width: int | None = None) -> torch.Tensor:
        """One row per length: fresh distinct pages, owned positions filled, padded with page 0."""
        P = self.P
        width = max([0] + [-(-n // P) for n in lens]) if width is None else width
        rows = []
        for n in lens:
            pages = [self.free.pop() for _ in range(-(-n // P))]
            for i, pg in enumerate(pages):
                m = min(P, n - i * P)
                hkv, d = self.k.shape[1:]
                for buf in (self.k, self.v):
                    vals = torch.randn(m, hkv, d, generator=self.gen).to(buf.dtype)
                    buf[pg * P : pg * P + m] = vals.to(DEV)
            rows.append(pages + [0] * (width - len(pages)))
        return torch.tensor(rows, dtype=torch.int32, device=DEV).reshape(len(lens), width)

    def gather(self, table_row: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(n, device=DEV)
        slots = table_row.long()[pos // self.P] * self.P + pos % self.P
        return self.k[slots], self.v[slots]


def dense_ref(q, k, v, visible, scale) -> torch.Tensor:
    """q [n, Hq, D], k/v [L, Hkv, D], visible [n, L] -> fp64 [n, Hq, D]."""
    g = q.shape[1] // k.shape[1]
    kf = k.double().repeat_interleave(g, 1)
    vf = v.double().repeat_interleave(g, 1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), kf) * scale
    s = s.masked_fill(~visible.to(DEV)[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), vf)


def tree_mask(n: int, rng: random.Random) -> torch.Tensor:
    """Random ancestor-closed mask: node i sees itself and every ancestor (row 0 is the root)."""
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if i:
            m[i] = m[rng.randrange(i)]
        m[i, i] = True
    return m


def ragged_lens(P: int, max_len: int, bsz: int, rng: random.Random) -> list[int]:
    """Lengths on a page boundary, across one, tiny and random."""
    on_boundary = P * rng.randint(1, max(1, max_len // P))
    cands = [on_boundary, min(max_len, on_boundary + 1), 1, rng.randint(1, max_len), max(1, on_boundary - 1)]
    return [min(max_len, c) for c in cands[:bsz]]


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "NaN/inf in kernel output"
    err = (out.double() - ref.double()).abs().max().item()
    assert err < tol(dtype), f"max abs diff {err}"


def dims():
    hkv, group, d, max_len, bsz = SHAPE
    return hkv, hkv * group, d, max_len, bsz


# ---------------------------------------------------------------- extend / verify


def make_extend(P: int, dtype: torch.dtype, tree: bool, seed: int, uniform_q_len: int = 0):
    """Ragged q_lens by default; uniform_q_len > 0 gives every request that many (a real tree verify)."""
    hkv, hq, d, max_len, bsz = dims()
    rng = random.Random(seed)
    q_lens = [rng.randint(1, 20) for _ in range(bsz)]
    q_lens[0] = 17  # more than one query block at BLOCK_M = 16
    if uniform_q_len:
        q_lens = [uniform_q_len] * bsz
    room = max_len - 20
    prefixes = [0, P * rng.randint(1, max(1, room // P)), rng.randint(1, room), rng.randint(1, room)][:bsz]
    kv = [p + q for p, q in zip(prefixes, q_lens)]
    cache = PagedCache(sum(-(-n // P) for n in kv) + 3, P, hkv, d, dtype, seed)
    table = cache.table(kv)
    qo = [0]
    for n in q_lens:
        qo.append(qo[-1] + n)
    q = torch.randn(qo[-1], hq, d, generator=cache.gen).to(dtype).to(DEV)
    masks = [tree_mask(n, rng) if tree else torch.ones(n, n, dtype=torch.bool).tril() for n in q_lens]
    meta = AttentionMetadata(
        mode=ForwardMode.TARGET_VERIFY if tree else ForwardMode.EXTEND,
        page_size=P,
        page_table=table,
        qo_indptr=torch.tensor(qo, dtype=torch.int32, device=DEV),
        prefix_lens=torch.tensor(prefixes, dtype=torch.int32, device=DEV),
        kv_lens=torch.tensor(kv, dtype=torch.int32, device=DEV),
        max_q_len=max(q_lens),
        max_kv_len=max(kv),
    )
    if tree:
        meta.custom_mask = torch.cat([m.reshape(-1) for m in masks]).to(DEV)
        sizes = [0] + [n * n for n in q_lens]
        meta.mask_indptr = torch.tensor(sizes, dtype=torch.int32, device=DEV).cumsum(0).to(torch.int32)
    ref = []
    for b in range(bsz):
        k, v = cache.gather(table[b], kv[b])
        vis = torch.cat([torch.ones(q_lens[b], prefixes[b], dtype=torch.bool), masks[b]], 1)
        ref.append(dense_ref(q[qo[b] : qo[b + 1]], k, v, vis, 0.3))
    return cache, q, meta, torch.cat(ref)


@pytest.mark.parametrize("P", PAGES)
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_matches_dense(P, tree, dtype):
    cache, q, meta, ref = make_extend(P, dtype, tree, seed=P * 7 + tree)
    out = paged_extend(
        q,
        cache.k,
        cache.v,
        meta.page_table,
        meta.qo_indptr,
        meta.prefix_lens,
        P,
        0.3,
        meta.max_q_len,
        meta.max_kv_len,
        meta.custom_mask,
        meta.mask_indptr,
        block_m=16,
        block_n=16,
    )
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, ref, dtype)


# ---------------------------------------------------------------- decode


def make_decode(
    P: int,
    dtype: torch.dtype,
    seed: int,
    heads: tuple[int, int, int] | None = None,
    lens: list[int] | None = None,
):
    """heads (kv heads, q heads, head dim) and lens default to SHAPE's and its ragged lengths."""
    hkv, hq, d, max_len, bsz = dims()
    if heads is not None:
        hkv, hq, d = heads
    if lens is None:
        kv = ragged_lens(P, max_len, bsz, random.Random(seed))
    else:
        kv, max_len, bsz = lens, max(lens), len(lens)
    cache = PagedCache(sum(-(-n // P) for n in kv) + 3, P, hkv, d, dtype, seed)
    table = cache.table(kv, width=-(-max_len // P) + 1)  # wider than needed: trailing padding pages
    q = torch.randn(bsz, hq, d, generator=cache.gen).to(dtype).to(DEV)
    meta = AttentionMetadata(
        mode=ForwardMode.DECODE,
        page_size=P,
        page_table=table,
        qo_indptr=torch.arange(bsz + 1, dtype=torch.int32, device=DEV),
        prefix_lens=torch.tensor([n - 1 for n in kv], dtype=torch.int32, device=DEV),
        kv_lens=torch.tensor(kv, dtype=torch.int32, device=DEV),
        max_q_len=1,
        max_kv_len=max(kv),
    )
    ref = []
    for b in range(bsz):
        k, v = cache.gather(table[b], kv[b])
        ref.append(dense_ref(q[b : b + 1], k, v, torch.ones(1, kv[b], dtype=torch.bool), 0.25))
    return cache, q, meta, torch.cat(ref)


@pytest.mark.parametrize("P", PAGES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_dense(P, splits, dtype):
    cache, q, meta, ref = make_decode(P, dtype, seed=P + splits)
    out = paged_decode(
        q, cache.k, cache.v, meta.page_table, meta.kv_lens, P, 0.25, num_splits=splits, block_n=16
    )
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


# ---------------------------------------------------------------- cascade draft decode


def make_cascade(P: int, K: int, dtype: torch.dtype, seed: int, empty_shared: bool = False):
    hkv, hq, d, max_len, bsz = dims()
    rng = random.Random(seed)
    bsz = min(bsz, 2) if K > 1 and not CUDA else bsz
    max_shared_pages = max(1, 48 // P)
    shared = [0 if empty_shared else P * rng.randint(0, max_shared_pages) for _ in range(bsz)]
    if not empty_shared:
        shared[0] = P * max_shared_pages
    # Branch r = b*K + t: duplicated tail (< P) plus its chain (1..4 tokens), inside its own pages.
    branch = [rng.randint(0, P - 1) + rng.randint(1, 4) for _ in range(bsz * K)]
    n_pages = sum(-(-n // P) for n in shared + branch) + 3
    cache = PagedCache(n_pages, P, hkv, d, dtype, seed)
    shared_table = cache.table(shared)
    branch_table = cache.table(branch)
    q = torch.randn(bsz * K, hq, d, generator=cache.gen).to(dtype).to(DEV)
    meta = AttentionMetadata(
        mode=ForwardMode.DRAFT_DECODE,
        page_size=P,
        shared_page_table=shared_table,
        shared_lens=torch.tensor(shared, dtype=torch.int32, device=DEV),
        branch_page_table=branch_table,
        branch_lens=torch.tensor(branch, dtype=torch.int32, device=DEV),
        topk=K,
    )
    ref = []
    for r in range(bsz * K):
        b = r // K
        k1, v1 = cache.gather(shared_table[b], shared[b])
        k2, v2 = cache.gather(branch_table[r], branch[r])
        k, v = torch.cat([k1, k2]), torch.cat([v1, v2])
        ref.append(dense_ref(q[r : r + 1], k, v, torch.ones(1, k.shape[0], dtype=torch.bool), 0.2))
    return cache, q, meta, torch.cat(ref)


@pytest.mark.parametrize("P", PAGES)
@pytest.mark.parametrize("K", [1, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cascade_matches_dense(P, K, dtype):
    cache, q, meta, ref = make_cascade(P, K, dtype, seed=P * 3 + K)
    splits = (2, 1) if P == 16 else (1, 2) if P == 4 else (None, None)
    out = cascade_decode(
        q,
        cache.k,
        cache.v,
        meta.shared_page_table,
        meta.shared_lens,
        meta.branch_page_table,
        meta.branch_lens,
        K,
        P,
        0.2,
        shared_splits=splits[0],
        branch_splits=splits[1],
        block_n=16,
    )
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("P", [1, 16])
def test_cascade_empty_shared_prefix(P):
    cache, q, meta, ref = make_cascade(P, 8, torch.float32, seed=11, empty_shared=True)
    for width in (meta.shared_page_table.shape[1], 0):  # all-padding table, then a zero-width one
        table = meta.shared_page_table[:, :width].contiguous()
        out = cascade_decode(
            q, cache.k, cache.v, table, meta.shared_lens, meta.branch_page_table, meta.branch_lens, 8, P, 0.2
        )
        assert_close(out, ref, torch.float32)


# ---------------------------------------------------------------- host-side checks


def test_host_checks_reject_bad_buffers():
    cache, q, meta, _ = make_cascade(4, 8, torch.float32, seed=5)
    args = [meta.shared_page_table, meta.shared_lens, meta.branch_page_table, meta.branch_lens]
    call = lambda *a, k=8: cascade_decode(q, cache.k, cache.v, *a, k, 4, 0.2)  # noqa: E731
    call(*args)
    bsz = meta.shared_lens.numel()
    with pytest.raises(AssertionError, match="branch_lens"):  # a branch buffer sized B, not B*K
        call(args[0], args[1], args[2], args[3][:bsz].contiguous())
    with pytest.raises(AssertionError, match="branch_page_table"):
        call(args[0], args[1], args[2][:bsz].contiguous(), args[3])
    with pytest.raises(AssertionError, match="int32"):
        call(args[0].long(), *args[1:])
    # Device lengths are checked on the host only where that is free (CPU); on a GPU this reads past the table.
    if not CUDA:
        with pytest.raises(AssertionError, match="page table width"):  # lengths reach past the table
            call(args[0], args[1], args[2][:, :1].contiguous(), args[3] + 8)
    with pytest.raises(AssertionError, match="q rows"):
        cascade_decode(q[:-1], cache.k, cache.v, *args, 8, 4, 0.2)
    dcache, dq, dmeta, _ = make_decode(4, torch.float32, seed=1)
    with pytest.raises(AssertionError, match="head_dim"):
        paged_decode(
            dq[..., :12], dcache.k[..., :12], dcache.v[..., :12], dmeta.page_table, dmeta.kv_lens, 4, 1.0
        )


# ---------------------------------------------------------------- backend vs torch_native


def finite(cache: PagedCache) -> PagedCache:
    """torch_native gathers whole padded tables, so its comparison needs a cache without NaN."""
    cache.k = torch.nan_to_num(cache.k, nan=0.5)
    cache.v = torch.nan_to_num(cache.v, nan=-0.5)
    return cache


@pytest.mark.parametrize("P", [1, 16])
def test_backend_matches_torch_native(P):
    triton_be, native = TritonAttnBackend(), TorchNativeAttnBackend()
    assert triton_be.name == "triton" and triton_be.supports_paged_tree_draft
    dtype = torch.float32
    cases = [
        (make_extend(P, dtype, tree=False, seed=21), triton_be.extend, native.extend, 0.3),
        (make_extend(P, dtype, tree=True, seed=22), triton_be.extend, native.extend, 0.3),
        (make_decode(P, dtype, seed=23), triton_be.decode, native.decode, 0.25),
        (
            make_cascade(P, 8, dtype, seed=24),
            triton_be.cascade_draft_decode,
            native.cascade_draft_decode,
            0.2,
        ),
        (
            make_cascade(P, 1, dtype, seed=25),
            triton_be.cascade_draft_decode,
            native.cascade_draft_decode,
            0.2,
        ),
    ]
    for (cache, q, meta, ref), ours, theirs, scale in cases:
        cache = finite(cache)
        out = ours(q, cache.k, cache.v, meta, scale)
        expect = theirs(q, cache.k, cache.v, meta, scale)
        assert_close(out, ref, dtype)
        assert_close(out, expect, dtype)


@pytest.mark.parametrize("kernel", ["extend", "verify", "decode", "cascade"])
def test_bf16(kernel):
    """bf16 caches (served on CPUs with AVX-512 BF16) must be exact up to bf16 rounding in every mode."""
    dtype, backend = torch.bfloat16, TritonAttnBackend()
    if kernel in ("extend", "verify"):
        cache, q, meta, ref = make_extend(16, dtype, tree=kernel == "verify", seed=31)
        out = backend.extend(q, cache.k, cache.v, meta, 0.3)
    elif kernel == "decode":
        cache, q, meta, ref = make_decode(16, dtype, seed=32)
        out = backend.decode(q, cache.k, cache.v, meta, 0.25)
    else:
        cache, q, meta, ref = make_cascade(16, 8, dtype, seed=33)
        out = backend.cascade_draft_decode(q, cache.k, cache.v, meta, 0.2)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


# ---------------------------------------------------------------- torch_native vs dense


@pytest.mark.parametrize("P", PAGES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_torch_native_batched_matches_dense(P, dtype, kind, monkeypatch):
    """Without the C kernel, decode and the tree verify (every request N queries) run as batched matmuls over
    head-major K/V, in one call or split into request chunks."""
    native = TorchNativeAttnBackend()
    native.use_kernel = False
    calls = []
    batched = native.attend_uniform
    monkeypatch.setattr(native, "attend_uniform", lambda *a: calls.append(a[-1]) or batched(*a))
    if kind == "decode":
        cache, q, meta, ref = make_decode(P, dtype, seed=40 + P)
        run, n = native.decode, 1
    else:
        cache, q, meta, ref = make_extend(P, dtype, tree=True, seed=41 + P, uniform_q_len=7)
        run, n = native.extend, 7
    cache = finite(cache)  # whole pages are read, positions past a length included (masked)
    for score_bytes in (256 << 20, 1):  # one call; one request per call
        monkeypatch.setattr(torch_native_backend, "SCORE_BYTES_PER_CALL", score_bytes)
        meta.derived.clear()
        out = run(q, cache.k, cache.v, meta, 0.25 if kind == "decode" else 0.3)
        assert out.dtype == dtype
        assert_close(out, ref, dtype)
    assert calls == [n, n]


def test_torch_native_ragged_verify_runs_per_request(monkeypatch):
    """Without the C kernel, unequal q_lens cannot share the batched layout: one SDPA per request."""
    native = TorchNativeAttnBackend()
    native.use_kernel = False
    monkeypatch.setattr(native, "attend_uniform", lambda *a: pytest.fail("batched path on ragged q_lens"))
    cache, q, meta, ref = make_extend(4, torch.float32, tree=True, seed=50)
    assert_close(native.extend(q, finite(cache).k, cache.v, meta, 0.3), ref, torch.float32)


def test_torch_native_fresh_prompt_attends_its_new_kv(monkeypatch):
    """A request without a cached prefix reads the K/V the forward just computed, not the pool: with its pool
    pages poisoned it still matches the dense reference (the others, with prefixes, still read the pool)."""
    native = TorchNativeAttnBackend()
    monkeypatch.setattr(torch_native_backend, "KERNEL_MAX_EXTEND", 0)  # SDPA per request, as a long prefill
    cache, q, meta, ref = make_extend(4, torch.float32, tree=False, seed=60)
    assert int(meta.prefix_lens[0]) == 0 and int(meta.prefix_lens[1]) > 0
    qo, prefix = meta.qo_indptr.tolist(), meta.prefix_lens.tolist()
    new_k, new_v = [], []
    for b in range(len(prefix)):
        k, v = cache.gather(meta.page_table[b], prefix[b] + qo[b + 1] - qo[b])
        new_k.append(k[prefix[b] :])
        new_v.append(v[prefix[b] :])
    new_kv = (torch.cat(new_k), torch.cat(new_v))
    cache = finite(cache)
    assert_close(native.extend(q, cache.k, cache.v, meta, 0.3, new_kv=new_kv), ref, torch.float32)
    n0 = qo[1] - qo[0]
    pos = torch.arange(n0, device=DEV)
    slots = meta.page_table[0].long()[pos // 4] * 4 + pos % 4
    cache.k[slots], cache.v[slots] = float("nan"), float("nan")
    out = native.extend(q, cache.k, cache.v, meta, 0.3, new_kv=new_kv)
    assert_close(out, ref, torch.float32)
    assert torch.isnan(native.extend(q, cache.k, cache.v, meta, 0.3)[: qo[1]]).all()  # the pool path reads NaN


# ---------------------------------------------------------------- the CPU kernel (torch_native) vs dense

needs_kernel = pytest.mark.skipif(
    CUDA or cpu_kernels.load() is None, reason="the C kernel serves CPU tensors and needs a C compiler"
)


def kernel_backend(monkeypatch) -> TorchNativeAttnBackend:
    """torch_native with its torch fallbacks made to fail: every call below must run in the kernel."""
    native = TorchNativeAttnBackend()
    monkeypatch.setattr(native, "attend_uniform", lambda *a: pytest.fail("torch path instead of the kernel"))
    monkeypatch.setattr(torch_native_backend, "gather_by_page_table", lambda *a: pytest.fail("gathered K/V"))
    return native


@needs_kernel
@pytest.mark.parametrize("P", PAGES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["decode", "verify", "ragged_verify", "extend", "cascade1", "cascade8"])
def test_cpu_kernel_matches_dense(P, dtype, kind, monkeypatch):
    """Every mode the kernel serves, on NaN-poisoned caches: a read of a padding page, of a position past a
    length or of another request's page shows up as NaN."""
    native = kernel_backend(monkeypatch)
    if kind == "decode":
        cache, q, meta, ref = make_decode(P, dtype, seed=60 + P)
        out, scale = native.decode, 0.25
    elif kind in ("verify", "ragged_verify", "extend"):
        uniform = 7 if kind == "verify" else 0
        cache, q, meta, ref = make_extend(P, dtype, tree=kind != "extend", seed=61 + P, uniform_q_len=uniform)
        out, scale = native.extend, 0.3
    else:
        cache, q, meta, ref = make_cascade(P, int(kind[-1]), dtype, seed=62 + P)
        out, scale = native.cascade_draft_decode, 0.2
    o = out(q, cache.k, cache.v, meta, scale)
    assert o.dtype == dtype and o.shape == q.shape
    assert_close(o, ref, dtype)


@needs_kernel
@pytest.mark.parametrize("P", [1, 16])
def test_cpu_kernel_cascade_empty_shared_prefix(P, monkeypatch):
    native = kernel_backend(monkeypatch)
    cache, q, meta, ref = make_cascade(P, 8, torch.float32, seed=11, empty_shared=True)
    for width in (meta.shared_page_table.shape[1], 0):  # all-padding table, then a zero-width one
        meta.shared_page_table = meta.shared_page_table[:, :width].contiguous()
        meta.derived.clear()
        assert_close(native.cascade_draft_decode(q, cache.k, cache.v, meta, 0.2), ref, torch.float32)


@needs_kernel
@pytest.mark.parametrize("P", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_model_shapes(P, dtype, monkeypatch):
    """SmolLM2's heads (9 query, 3 kv: a group of 3, head dim 64), contexts long enough to be split into
    several KV chunks across threads, a verify with more queries than one task's tile (the transposed-K path)
    and a decode (the dot-product path), against the dense reference and the torch path."""
    hkv, hq, d = 3, 9, 64
    lens, n = [1100, 300, 1, 733], 21
    gen = torch.Generator().manual_seed(P)
    cache = PagedCache(sum(-(-(x + n) // P) for x in lens) + 3, P, hkv, d, dtype, seed=70 + P)
    kv = [x + n for x in lens]
    table = cache.table(kv)
    q = torch.randn(len(lens) * n, hq, d, generator=gen).to(dtype)
    rng = random.Random(P)
    masks = [tree_mask(n, rng) for _ in lens]
    meta = AttentionMetadata(
        mode=ForwardMode.TARGET_VERIFY,
        page_size=P,
        page_table=table,
        qo_indptr=torch.arange(0, (len(lens) + 1) * n, n, dtype=torch.int32),
        prefix_lens=torch.tensor(lens, dtype=torch.int32),
        kv_lens=torch.tensor(kv, dtype=torch.int32),
        max_q_len=n,
        max_kv_len=max(kv),
        custom_mask=torch.cat([m.reshape(-1) for m in masks]),
        mask_indptr=torch.arange(0, (len(lens) + 1) * n * n, n * n, dtype=torch.int32),
    )
    ref = []
    for b, L in enumerate(lens):
        k, v = cache.gather(table[b], kv[b])
        vis = torch.cat([torch.ones(n, L, dtype=torch.bool), masks[b]], 1)
        ref.append(dense_ref(q[b * n : (b + 1) * n], k, v, vis, 0.125))
    ref = torch.cat(ref)
    out = kernel_backend(monkeypatch).extend(q, cache.k, cache.v, meta, 0.125)
    assert_close(out, ref, dtype)
    # Decode (3 rows per kv head: the dot-product path) of each request's last query over the same pages.
    dec = AttentionMetadata(
        mode=ForwardMode.DECODE,
        page_size=P,
        page_table=table,
        qo_indptr=torch.arange(len(lens) + 1, dtype=torch.int32),
        prefix_lens=meta.kv_lens - 1,
        kv_lens=meta.kv_lens,
        max_q_len=1,
        max_kv_len=max(kv),
    )
    qd = q[n - 1 :: n].contiguous()
    dec_ref = []
    for b in range(len(lens)):
        k, v = cache.gather(table[b], kv[b])
        dec_ref.append(dense_ref(qd[b : b + 1], k, v, torch.ones(1, kv[b], dtype=torch.bool), 0.125))
    dec_out = kernel_backend(monkeypatch).decode(qd, cache.k, cache.v, dec, 0.125)
    assert_close(dec_out, torch.cat(dec_ref), dtype)
    monkeypatch.undo()
    torch_path = TorchNativeAttnBackend()
    torch_path.use_kernel = False
    expect = torch_path.extend(q, finite(cache).k, cache.v, meta, 0.125)
    assert (out.double() - expect.double()).abs().max().item() < tol(dtype)


@needs_kernel
@pytest.mark.parametrize("d", [16, 32, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_decode_head_dims(d, dtype, monkeypatch):
    """The dot-product decode path blocks a row's columns by 4 and 1 vectors and a block's positions by the
    vector width, and takes bf16 scores 32 values at a time where the CPU has VDPBF16PS (16 and 96 are not
    multiples of 32 and 64): head dims that use each column block, and lengths that end mid-group, against the
    dense reference."""
    cache, q, meta, ref = make_decode(4, dtype, seed=d, heads=(2, 6, d), lens=[1, 5, 37, 70])
    assert_close(kernel_backend(monkeypatch).decode(q, cache.k, cache.v, meta, 0.25), ref, dtype)


@needs_kernel
@pytest.mark.parametrize("group", [1, 2, 4, 5, 7, 15])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_decode_group_sizes(group, dtype, monkeypatch):
    """The dot path's P.V takes a kv head's query rows a register tile at a time (4 rows with AVX-512, 2 with
    AVX2) and the rest in one smaller tile: every group size the path serves (up to 15 rows) against the dense
    reference."""
    cache, q, meta, ref = make_decode(16, dtype, seed=group, heads=(2, 2 * group, 64), lens=[3, 40, 300])
    assert_close(kernel_backend(monkeypatch).decode(q, cache.k, cache.v, meta, 0.25), ref, dtype)


@needs_kernel
def test_cpu_kernel_not_used_for_fp16_or_long_prefill(monkeypatch):
    """fp16 has no kernel variant and long prefills are SDPA's: both take the torch path."""
    native = TorchNativeAttnBackend()
    cache, q, meta, ref = make_decode(4, torch.float16, seed=80)
    assert native.kernel_for(q, cache.k) is None
    assert_close(native.decode(q, finite(cache).k, cache.v, meta, 0.25), ref, torch.float16)
    monkeypatch.setattr(torch_native_backend, "KERNEL_MAX_EXTEND", 4)
    monkeypatch.setattr(cpu_kernels, "paged_attention", lambda *a, **k: pytest.fail("kernel on a prefill"))
    cache, q, meta, ref = make_extend(4, torch.float32, tree=False, seed=81)
    assert_close(native.extend(q, finite(cache).k, cache.v, meta, 0.3), ref, torch.float32)
