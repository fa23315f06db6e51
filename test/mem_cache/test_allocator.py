from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepage.mem_cache.allocator import MemoryLeakError, PagedAllocator
from treepage.mem_cache.memory_pool import ReqToTokenPool, free_row, grow_row

PAGE_SIZES = [1, 2, 4, 8, 16, 64]


def test_construction_and_padding_page():
    a = PagedAllocator(num_pages=5, page_size=4)
    assert (a.num_pages, a.num_slots, a.num_free_pages(), a.num_used_pages()) == (5, 24, 5, 0)
    pages = a.alloc_pages(5)
    assert sorted(pages.tolist()) == [1, 2, 3, 4, 5]  # page 0 is never handed out
    assert a.alloc_pages(1) is None
    with pytest.raises(ValueError, match="padding"):
        a.free_pages(torch.tensor([0]))
    for bad in (0, 3, 2048):
        with pytest.raises(ValueError):
            PagedAllocator(4, bad)


def test_alloc_failure_takes_nothing():
    a = PagedAllocator(num_pages=3, page_size=2)
    a.alloc_pages(2)
    assert a.alloc_pages(2) is None
    assert a.num_free_pages() == 1
    a.check_leak(expected_used=2)


def test_double_free_raises_and_changes_nothing():
    a = PagedAllocator(num_pages=4, page_size=8)
    p = a.alloc_pages(2)
    a.free_pages(p[:1])
    with pytest.raises(ValueError, match="double free"):
        a.free_pages(p)  # p[1] valid, p[0] already free: nothing may be freed
    assert a.num_used_pages() == 1
    with pytest.raises(ValueError, match="double free"):
        a.free_pages(torch.stack([p[1], p[1]]))
    a.free_pages(p[1:])
    a.check_leak(0)


def test_check_leak_catches_held_pages():
    a = PagedAllocator(num_pages=4, page_size=2)
    p = a.alloc_pages(3)
    with pytest.raises(MemoryLeakError, match="3 pages in use"):
        a.check_leak()
    a.check_leak(expected_used=3)
    a.free_pages(p)
    a.check_leak()


@settings(max_examples=60, deadline=None)
@given(
    num_pages=st.integers(1, 30),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=40),
)
def test_pages_never_handed_out_twice(num_pages, ops):
    a = PagedAllocator(num_pages, page_size=4)
    held: list[torch.Tensor] = []
    for is_alloc, n in ops:
        if is_alloc:
            got = a.alloc_pages(n)
            if got is None:
                assert n > a.num_free_pages()
                continue
            held.append(got)
        elif held:
            batch = held.pop(n % len(held))
            a.free_pages(batch)
            if batch.numel():
                with pytest.raises(ValueError):
                    a.free_pages(batch)
        ids = torch.cat(held).tolist() if held else []
        assert len(ids) == len(set(ids)) and all(1 <= p <= num_pages for p in ids)
        a.check_leak(expected_used=len(ids))
    for batch in held:
        a.free_pages(batch)
    a.check_leak(0)
    assert a.num_free_pages() == num_pages


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from(PAGE_SIZES),
    num_pages=st.integers(1, 24),
    ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 70)), max_size=30),
)
def test_grow_row_keeps_slot_mod_page(page_size, num_pages, ops):
    """Through grow_row, slots stay unique, off the padding page, and slot % P == pos % P."""
    P = page_size
    a = PagedAllocator(num_pages, P)
    pool = ReqToTokenPool(4, row_width=num_pages * P)
    lens = [0, 0, 0, 0]
    for row, delta in ops:
        if delta == 0:
            free_row(pool, a, row, 0, lens[row])
            lens[row] = 0
        else:
            before = pool.req_to_token.clone()
            free_before = a.num_free_pages()
            need = -(-(lens[row] + delta) // P) - (-(-lens[row] // P))
            if grow_row(pool, a, row, lens[row], lens[row] + delta):
                lens[row] += delta
            else:
                assert need > free_before
                assert torch.equal(pool.req_to_token, before) and a.num_free_pages() == free_before
        slots, pos = [], []
        for r in range(4):
            slots.append(pool.req_to_token[r, : lens[r]])
            pos.append(torch.arange(lens[r]))
        slots_t, pos_t = torch.cat(slots), torch.cat(pos)
        assert slots_t.unique().numel() == slots_t.numel()
        assert bool((slots_t % P == pos_t % P).all())
        assert bool((slots_t >= P).all()) and bool((slots_t < a.num_slots).all())
        a.check_leak(expected_used=sum(-(-n // P) for n in lens))
    for r in range(4):
        free_row(pool, a, r, 0, lens[r])
    a.check_leak(0)
    assert a.num_free_pages() == num_pages


def test_cheap_check_catches_held_pages_and_full_check_catches_corruption():
    a = PagedAllocator(num_pages=4, page_size=2)
    p = a.alloc_pages(2)
    with pytest.raises(MemoryLeakError, match="2 pages in use"):
        a.check_leak(full=False)  # the O(1) idle check still sees pages nobody holds
    a.check_leak(expected_used=2, full=False)
    a.free_pages(p)
    a._free.append(a._free[0])  # corrupt the free list: a page listed twice
    a._free.pop(1)
    a.check_leak(full=False)  # counts still add up, so only the structural scan can tell
    with pytest.raises(MemoryLeakError, match="duplicates in free list: 1"):
        a.check_leak()
