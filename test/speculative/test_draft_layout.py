from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepage.mem_cache.allocator import MemoryLeakError, PagedAllocator
from treepage.mem_cache.memory_pool import KVPool, ReqToTokenPool, build_page_table, free_row, grow_row
from treepage.mem_cache.sizing import (
    RowWidthError,
    check_row_width,
    get_alloc_len_per_decode,
    get_alloc_reserve_per_decode,
    get_row_width,
    next_alloc_target,
    reserve_decode_slots,
)
from treepage.speculative.draft_layout import (
    branch_page_table,
    compute_draft_layout,
    draft_out_cache_loc,
    draft_positions,
    draft_region_end,
    duplicate_prefix_tail_to_draft_branches,
    hole_positions,
    num_new_pages_max,
    shared_prefix_page_table,
)


@dataclass
class Args:
    page_size: int
    speculative_eagle_topk: int
    speculative_num_steps: int
    speculative_num_draft_tokens: int
    speculative_algorithm: str = "EAGLE3"


def test_design_worked_example():
    """DESIGN section 4: P=64, L=1000, S=3, K=8."""
    lay = compute_draft_layout(torch.tensor([1000]), page_size=64, topk=8, num_steps=3)
    assert (lay.last_page.item(), lay.prefix_base.item(), lay.num_new_pages.item()) == (40, 960, 1)
    pos = draft_positions(lay)[0]
    for t in range(8):
        assert pos[t].tolist() == [1000 + 64 * t, 1001 + 64 * t, 1002 + 64 * t]
    assert draft_region_end(lay).item() == 960 + 8 * 64
    req, src, dst = hole_positions(lay)
    assert req.tolist() == [0] * (7 * 40)
    for t in range(1, 8):
        seg = slice((t - 1) * 40, t * 40)
        assert src[seg].tolist() == list(range(960, 1000))
        assert dst[seg].tolist() == list(range(960 + 64 * t, 1000 + 64 * t))
    assert num_new_pages_max(64, 3) == 2


@pytest.mark.parametrize("P,K", [(1, 1), (1, 8), (16, 1), (64, 1)])
def test_degrades_to_contiguous(P, K):
    L = torch.tensor([0, 5, 63, 64, 1000])
    S = 4
    lay = compute_draft_layout(L, P, K, S)
    t = torch.arange(K)[None, :, None]
    s = torch.arange(S)[None, None, :]
    assert torch.equal(draft_positions(lay), L[:, None, None] + t * S + s)
    assert hole_positions(lay)[0].numel() == 0
    if P == 1:
        assert torch.equal(lay.prefix_base, L) and lay.last_page.abs().sum() == 0
        assert torch.equal(lay.num_new_pages, torch.full_like(L, S))


def _setup(lens, P, K, S, N, lags):
    """Real rows: prefill to L, then a v2 decode reserve with the committed length lagging by `lags`."""
    args = Args(P, K, S, N)
    reserve = get_alloc_reserve_per_decode(args)
    context_len = max(lens) + 1
    row_width = get_row_width(context_len, args)
    committed = [L - lag for L, lag in zip(lens, lags)]
    need = sum(-(-next_alloc_target(L, c, reserve, P) // P) for L, c in zip(lens, committed))
    alloc = PagedAllocator(need + 3, P)
    pool = ReqToTokenPool(len(lens) + 1, row_width)
    rows = [pool.alloc() for _ in lens]
    rows = rows[::-1]  # rows in an order unrelated to batch index
    for r, L in zip(rows, lens):
        assert grow_row(pool, alloc, r, 0, L)
    nxt = reserve_decode_slots(pool, alloc, rows, list(lens), committed, reserve, P, (K, S, N))
    assert nxt is not None
    return args, reserve, committed, alloc, pool, rows, nxt


@st.composite
def configs(draw):
    P = draw(st.sampled_from([1 << i for i in range(10)]))
    K = draw(st.integers(1, 10))
    S = draw(st.integers(1, 8))
    N = S + 1 if K == 1 else draw(st.integers(2, 1 + S * K))
    B = draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(1, 2500), min_size=B, max_size=B))
    alloc_len = get_alloc_len_per_decode(Args(P, K, S, N))
    lags = [draw(st.integers(0, min(L, alloc_len))) for L in lens]
    return P, K, S, N, lens, lags


@settings(max_examples=60, deadline=None)
@given(cfg=configs())
def test_layout_properties(cfg):
    P, K, S, N, lens, lags = cfg
    args, reserve, committed, alloc, pool, rows, nxt = _setup(lens, P, K, S, N, lags)
    r2t = pool.req_to_token
    rows_t = torch.tensor(rows)
    lay = compute_draft_layout(torch.tensor(lens), P, K, S)
    B = len(lens)
    ends = draft_region_end(lay).tolist()

    # inside the allocation and the row: draft tokens, branch regions and the verify window
    # <= committed + reserve <= nxt <= row width (at K == 1 the single region's tail page is rounded up
    # to a whole page, which nxt's page round-up covers)
    last_draft = draft_positions(lay).amax(dim=(1, 2)).tolist()
    for b in range(B):
        assert last_draft[b] + 1 <= committed[b] + reserve and lens[b] + N <= committed[b] + reserve
        assert K == 1 or ends[b] <= committed[b] + reserve
        assert ends[b] <= nxt[b] <= pool.row_width
        assert lay.num_new_pages[b].item() <= lay.max_num_new_pages == num_new_pages_max(P, S)

    # branch regions are whole pages, disjoint across branches and requests; draft slots inside their own region
    loc = draft_out_cache_loc(r2t, rows_t, lay)
    pos = draft_positions(lay)
    owner: dict[int, tuple[int, int]] = {}
    for b in range(B):
        nnp = lay.num_new_pages[b].item()
        pb, lp = lay.prefix_base[b].item(), lay.last_page[b].item()
        for t in range(K):
            start = pb + t * nnp * P
            assert start % P == 0
            region = r2t[rows[b], start : start + nnp * P].tolist()
            for slot in region:
                assert slot >= P and owner.setdefault(slot, (b, t)) == (b, t)
            assert pos[b, t].tolist() == list(range(start + lp, start + lp + S))
            assert loc[b, t].tolist() == region[lp : lp + S]
    assert loc.unique().numel() == loc.numel()

    # hole positions are exactly the prefix-tail offsets
    req, src, dst = hole_positions(lay)
    expect = [
        (
            b,
            lay.prefix_base[b].item() + j,
            lay.prefix_base[b].item() + t * lay.num_new_pages[b].item() * P + j,
        )
        for b in range(B)
        for t in range(1, K)
        for j in range(lay.last_page[b].item())
    ]
    assert list(zip(req.tolist(), src.tolist(), dst.tolist())) == expect

    # page tables: shared whole-page prefix, and each branch's own pages up to the current step
    spt, slens = shared_prefix_page_table(r2t, rows_t, lay)
    assert torch.equal(slens, lay.prefix_base)
    assert torch.equal(spt, build_page_table(r2t, rows_t, lay.prefix_base, P, max_len=lay.max_prefix_base))
    step = S - 1
    bpt, blens = branch_page_table(r2t, rows_t, lay, step)
    assert bpt.shape == (B * K, lay.max_num_new_pages)
    for b in range(B):
        nnp, pb, lp = lay.num_new_pages[b].item(), lay.prefix_base[b].item(), lay.last_page[b].item()
        for t in range(K):
            n_pages = -(-(lp + step + 1) // P)
            start = pb + t * nnp * P
            want = [r2t[rows[b], start + i * P].item() // P for i in range(n_pages)]
            assert bpt[b * K + t].tolist() == want + [0] * (lay.max_num_new_pages - n_pages)
            assert blens[b * K + t].item() == lp + step + 1

    # duplication copies exactly the holes and changes no other byte of the pool
    kv = KVPool(alloc.num_slots, num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    kv.kv_data.copy_(torch.randn_like(kv.kv_data))
    before = kv.kv_data.clone()
    duplicate_prefix_tail_to_draft_branches(kv, r2t, rows_t, lay, impl="torch")
    expected = before.clone()
    for b, s_pos, d_pos in expect:
        expected[:, :, r2t[rows[b], d_pos]] = before[:, :, r2t[rows[b], s_pos]]
    assert torch.equal(kv.kv_data, expected)

    for r, n in zip(rows, nxt):
        free_row(pool, alloc, r, 0, n)
        pool.free(r)
    alloc.check_leak(0)
    pool.check_leak(0)


def test_check_row_width_message():
    check_row_width([10, 20], 20, 64, 8, 3, 16)
    check_row_width([5], 5, 1, 1, 1, 2)
    with pytest.raises(RowWidthError) as e:
        check_row_width([10, 2111], 2110, 64, 8, 3, 16)
    msg = str(e.value)
    for part in ("nxt=2111", "2110", "page_size=64", "topk=8", "num_steps=3", "num_draft_tokens=16"):
        assert part in msg
    assert "TREEPAGE_DEBUG_NARROW_ROWS" in msg and "get_row_width" in msg


def test_reserve_out_of_pages_leaves_nothing_half_allocated():
    P, K, S, N = 4, 2, 2, 3
    args = Args(P, K, S, N)
    reserve = get_alloc_reserve_per_decode(args)  # 2 * max(1*4*2, 3) = 16
    alloc = PagedAllocator(num_pages=7, page_size=P)
    pool = ReqToTokenPool(2, get_row_width(64, args))
    assert grow_row(pool, alloc, 0, 0, 5) and grow_row(pool, alloc, 1, 0, 5)  # 4 pages used
    before = pool.req_to_token.clone()
    # each request needs ceil((5+16)/4) = 6 pages in all: 8 more, 3 free
    assert reserve_decode_slots(pool, alloc, [0, 1], [5, 5], [5, 5], reserve, P, (K, S, N)) is None
    assert torch.equal(pool.req_to_token, before) and alloc.num_used_pages() == 4
    free_row(pool, alloc, 0, 0, 5)
    free_row(pool, alloc, 1, 0, 5)
    alloc.check_leak()


FAIL_CFGS = [(256, 8, 5, 32), (1, 8, 5, 32), (4, 1, 7, 8)]


@pytest.mark.parametrize("P,K,S,N", FAIL_CFGS)
def test_narrow_rows_overflow_leaks_and_the_invariant_stops_it(P, K, S, N, monkeypatch):
    """Row narrower than committed + reserve: the unchecked write spills and leaks; the check refuses first."""
    args = Args(P, K, S, N)
    reserve = get_alloc_reserve_per_decode(args)
    context_len = 4096
    L = context_len - 1  # a request at the end of its context
    nxt = next_alloc_target(L, L, reserve, P)
    pages_total = -(-nxt // P)

    monkeypatch.setenv("TREEPAGE_DEBUG_NARROW_ROWS", "1")
    narrow = get_row_width(context_len, args)
    assert narrow == context_len + 4 + N and nxt > narrow

    # 1) no check: the round's write spills into the idle neighbour row and the free leaks
    alloc = PagedAllocator(pages_total + 4, P)
    pool = ReqToTokenPool(4, narrow)
    assert grow_row(pool, alloc, 0, 0, L)
    assert grow_row(pool, alloc, 0, L, nxt)
    assert pool.req_to_token[1].abs().sum() > 0  # neighbour row overwritten
    free_row(pool, alloc, 0, 0, nxt)
    leaked = pages_total - (-(-narrow // P))
    assert alloc.num_used_pages() == leaked > 0
    with pytest.raises(MemoryLeakError):
        alloc.check_leak()

    # 2) reserve_decode_slots raises before any write; nothing leaks
    alloc = PagedAllocator(pages_total + 4, P)
    pool = ReqToTokenPool(4, narrow)
    assert grow_row(pool, alloc, 0, 0, L)
    before, used = pool.req_to_token.clone(), alloc.num_used_pages()
    with pytest.raises(RowWidthError, match=f"nxt={nxt}"):
        reserve_decode_slots(pool, alloc, [0], [L], [L], reserve, P, (K, S, N))
    assert torch.equal(pool.req_to_token, before) and alloc.num_used_pages() == used
    free_row(pool, alloc, 0, 0, L)
    alloc.check_leak()

    # 3) widened rows: the round completes and frees to zero
    monkeypatch.delenv("TREEPAGE_DEBUG_NARROW_ROWS")
    wide = get_row_width(context_len, args)
    assert wide >= nxt
    alloc = PagedAllocator(pages_total + 4, P)
    pool = ReqToTokenPool(4, wide)
    assert grow_row(pool, alloc, 0, 0, L)
    assert reserve_decode_slots(pool, alloc, [0], [L], [L], reserve, P, (K, S, N)) == [nxt]
    assert pool.req_to_token[1].abs().sum() == 0
    free_row(pool, alloc, 0, 0, nxt)
    alloc.check_leak()
