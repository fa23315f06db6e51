from __future__ import annotations

import pytest
import torch

from treepage.mem_cache.allocator import MemoryLeakError, PagedAllocator
from treepage.mem_cache.memory_pool import (
    KVPool,
    ReqToTokenPool,
    build_page_table,
    free_row,
    grow_row,
    write_row_slots,
)


def test_req_to_token_pool_rows():
    pool = ReqToTokenPool(size=3, row_width=5)
    assert pool.req_to_token.shape == (3, 5) and pool.req_to_token.dtype == torch.int64
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and pool.alloc() is None and pool.num_free() == 0
    with pytest.raises(MemoryLeakError):
        pool.check_leak()
    pool.free(rows[1])
    with pytest.raises(ValueError, match="double free"):
        pool.free(rows[1])
    pool.check_leak(expected_used=2)
    pool.free(rows[0])
    pool.free(rows[2])
    pool.check_leak()


def test_kv_pool_set_get_and_layout():
    pool = KVPool(num_slots=8, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float16)
    assert pool.kv_data.shape == (2, 3, 8, 2, 4) and pool.kv_data.is_contiguous()
    assert pool.nbytes == 2 * 3 * 8 * 2 * 4 * 2
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    pool.set_kv(1, torch.tensor([5, 2]), k, v)
    kc, vc = pool.get_kv(1)
    assert kc.shape == (8, 2, 4) and kc.data_ptr() == pool.kv_data[0, 1].data_ptr()  # a view
    assert torch.equal(kc[5], k[0].half()) and torch.equal(vc[2], v[1].half())
    assert pool.kv_data[:, [0, 2]].abs().sum() == 0  # other layers untouched


def test_move_kv_cache_reads_all_sources_first():
    pool = KVPool(num_slots=6, num_layers=2, num_kv_heads=1, head_dim=3, dtype=torch.float32)
    pool.kv_data.copy_(torch.randn_like(pool.kv_data))
    before = pool.kv_data.clone()
    # a swap plus a chain (4 <- 3 while 3 <- 2): only correct if every source is read before writing
    pool.move_kv_cache(torch.tensor([1, 0, 4, 3]), torch.tensor([0, 1, 3, 2]))
    expected = before.clone()
    expected[:, :, [1, 0, 4, 3]] = before[:, :, [0, 1, 3, 2]]
    assert torch.equal(pool.kv_data, expected)


def test_grow_row_fills_partial_page_first():
    a = PagedAllocator(num_pages=8, page_size=4)
    pool = ReqToTokenPool(2, row_width=16)
    assert grow_row(pool, a, 0, 0, 6)  # pages 1, 2
    assert pool.req_to_token[0, :6].tolist() == [4, 5, 6, 7, 8, 9]
    assert grow_row(pool, a, 0, 6, 11)  # finishes page 2, then page 3
    assert pool.req_to_token[0, :11].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert a.num_used_pages() == 3
    assert grow_row(pool, a, 1, 0, 3)
    assert not grow_row(pool, a, 1, 3, 40)  # needs 9 more pages, 4 are free
    assert a.num_used_pages() == 4 and pool.req_to_token[1, 3:].abs().sum() == 0
    free_row(pool, a, 0, 0, 11)
    free_row(pool, a, 1, 0, 3)
    a.check_leak()


def test_build_page_table_pads_with_page_zero():
    a = PagedAllocator(num_pages=8, page_size=4)
    pool = ReqToTokenPool(3, row_width=16)
    grow_row(pool, a, 2, 0, 10)  # pages 1, 2, 3
    grow_row(pool, a, 0, 0, 3)  # page 4
    rows, lens = torch.tensor([2, 0]), torch.tensor([10, 3])
    pt = build_page_table(pool.req_to_token, rows, lens, 4)
    assert pt.tolist() == [[1, 2, 3], [4, 0, 0]] and pt.dtype == torch.int64
    assert build_page_table(pool.req_to_token, rows, lens, 4, max_len=16).shape == (2, 4)
    # P == 1: the page table is the slot list
    a1 = PagedAllocator(num_pages=20, page_size=1)
    pool1 = ReqToTokenPool(2, row_width=8)
    grow_row(pool1, a1, 1, 0, 5)
    grow_row(pool1, a1, 0, 0, 2)
    pt1 = build_page_table(pool1.req_to_token, torch.tensor([1, 0]), torch.tensor([5, 2]), 1)
    assert pt1[0].tolist() == pool1.req_to_token[1, :5].tolist()
    assert pt1[1].tolist() == pool1.req_to_token[0, :2].tolist() + [0, 0, 0]


def test_write_past_row_end_spills_and_free_row_leaks():
    """The failure the row-width invariant prevents: the spill lands in the next row, the free clamps."""
    a = PagedAllocator(num_pages=8, page_size=4)
    pool = ReqToTokenPool(2, row_width=8)
    write_row_slots(pool.req_to_token, 0, 6, torch.tensor([101, 102, 103, 104]))
    assert pool.req_to_token[0, 6:].tolist() == [101, 102]
    assert pool.req_to_token[1, :2].tolist() == [103, 104]

    pool.req_to_token.zero_()
    assert grow_row(pool, a, 0, 0, 12)  # 3 pages, the third one written into row 1
    assert pool.req_to_token[1, :4].tolist() == [12, 13, 14, 15]
    free_row(pool, a, 0, 0, 12)  # slice clamps at 8: the third page is never returned
    with pytest.raises(MemoryLeakError, match="1 pages in use"):
        a.check_leak()


def test_free_row_partial_range():
    a = PagedAllocator(num_pages=8, page_size=4)
    pool = ReqToTokenPool(1, row_width=32)
    grow_row(pool, a, 0, 0, 20)
    free_row(pool, a, 0, 8, 20)  # keep the first two pages
    a.check_leak(expected_used=2)
    with pytest.raises(ValueError, match="page-aligned"):
        free_row(pool, a, 0, 3, 8)
    free_row(pool, a, 0, 0, 8)
    a.check_leak()
