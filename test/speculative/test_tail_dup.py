"""Triton tail duplication == torch reference, bit for bit (interpreted on CPU, native on CUDA)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel's first import

import pytest  # noqa: E402

from treepage.mem_cache.allocator import PagedAllocator  # noqa: E402
from treepage.mem_cache.memory_pool import KVPool, ReqToTokenPool, grow_row  # noqa: E402
from treepage.speculative.draft_layout import (  # noqa: E402
    compute_draft_layout,
    duplicate_prefix_tail_to_draft_branches,  # noqa: E402
    hole_positions,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _make(lens, P, K, S, dtype, layers=2, heads=2, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    alloc_len = -(-(P - 1 + S) // P) * P * K
    width = max(lens) + alloc_len + P
    pages = sum(-(-w // P) for w in [width] * len(lens)) + 1
    alloc = PagedAllocator(pages, P, device=DEVICE)
    pool = ReqToTokenPool(len(lens) + 2, width, device=DEVICE)
    rows = [len(lens) + 1 - i for i in range(len(lens))]  # not 0..B-1
    for r, L in zip(rows, lens):
        assert grow_row(pool, alloc, r, 0, L + alloc_len)
    kv = KVPool(alloc.num_slots, layers, heads, dim, dtype, device=DEVICE)
    bits = kv.kv_data.view(_INT[kv.kv_data.element_size()])
    info = torch.iinfo(bits.dtype)
    bits.copy_(torch.randint(info.min, info.max, bits.shape, generator=g, dtype=torch.int64).to(bits.dtype))
    layout = compute_draft_layout(torch.tensor(lens, device=DEVICE), P, K, S)
    return kv, pool, torch.tensor(rows, device=DEVICE), layout


CASES = [
    # lens, P, K, S: multi-block tails (P=64 -> 4 offset blocks), last_page 0 mixed in, nnp 2, K up to 4
    ([70, 5, 64], 8, 3, 2),
    ([100, 127], 64, 2, 3),
    ([13, 6], 8, 4, 7),
    ([3], 4, 2, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens,P,K,S", CASES)
def test_triton_matches_torch_bit_for_bit(lens, P, K, S, dtype):
    kv_t, pool, rows, layout = _make(lens, P, K, S, dtype)
    kv_r = KVPool(kv_t.num_slots, kv_t.num_layers, kv_t.num_kv_heads, kv_t.head_dim, dtype, device=DEVICE)
    kv_r.kv_data.copy_(kv_t.kv_data)
    before = kv_t.kv_data.clone()

    duplicate_prefix_tail_to_draft_branches(kv_t, pool.req_to_token, rows, layout, impl="triton")
    duplicate_prefix_tail_to_draft_branches(kv_r, pool.req_to_token, rows, layout, impl="torch")

    ibits = _INT[kv_t.kv_data.element_size()]
    assert torch.equal(kv_t.kv_data.view(ibits), kv_r.kv_data.view(ibits))
    if dtype == torch.bfloat16:  # also compare loaded and upcast, as a value check
        assert torch.equal(kv_t.kv_data.float().nan_to_num(7.0), kv_r.kv_data.float().nan_to_num(7.0))
    # the kernel did copy something, and only into the holes
    req, src, dst = hole_positions(layout)
    r2t = pool.req_to_token
    dst_slots = r2t[rows[req], dst]
    changed = (kv_t.kv_data.view(ibits) != before.view(ibits)).flatten(3).any(-1).any(0).any(0)
    assert changed.any()
    mask = torch.zeros_like(changed)
    mask[dst_slots] = True
    assert not bool((changed & ~mask).any())
    assert torch.equal(
        kv_t.kv_data[:, :, dst_slots].view(ibits), before[:, :, r2t[rows[req], src]].view(ibits)
    )


def test_noop_when_contiguous():
    for P, K in [(1, 4), (8, 1)]:
        kv, pool, rows, layout = _make([9, 17], P, K, 3, torch.float32)
        before = kv.kv_data.clone()
        duplicate_prefix_tail_to_draft_branches(kv, pool.req_to_token, rows, layout, impl="triton")
        assert torch.equal(kv.kv_data.view(torch.int32), before.view(torch.int32))


def test_unknown_impl_rejected():
    kv, pool, rows, layout = _make([9], 8, 2, 2, torch.float32)
    with pytest.raises(ValueError, match="unknown impl"):
        duplicate_prefix_tail_to_draft_branches(kv, pool.req_to_token, rows, layout, impl="cuda")
