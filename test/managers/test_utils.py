from __future__ import annotations

from dataclasses import dataclass

import pytest

from treepage.mem_cache.sizing import (
    ceil_div,
    ceil_to_page,
    get_alloc_len_per_decode,
    get_alloc_reserve_per_decode,
    get_row_width,
    get_row_width_extra,
    next_alloc_target,
    speculation_enabled,
)


@dataclass
class Args:
    speculative_algorithm: str | None = "EAGLE3"
    page_size: int = 1
    speculative_eagle_topk: int = 1
    speculative_num_steps: int = 1
    speculative_num_draft_tokens: int = 2
    disable_overlap_schedule: bool = False


def spec(P: int, K: int, S: int, N: int, **kw) -> Args:
    return Args(
        page_size=P, speculative_eagle_topk=K, speculative_num_steps=S, speculative_num_draft_tokens=N, **kw
    )


# DESIGN section 3: (P, K, S, N) -> alloc_len, reserve, extra
TABLE = [
    ((64, 8, 3, 16), 1024, 2048, 2111),
    ((64, 8, 5, 32), 1024, 2048, 2111),
    ((4, 8, 5, 64), 64, 128, 131),
    ((1, 8, 5, 32), 40, 80, 80),
    ((16, 1, 3, 4), 4, 8, 23),
]


@pytest.mark.parametrize("cfg,alloc_len,reserve,extra", TABLE, ids=lambda x: str(x))
def test_design_table_row(cfg, alloc_len, reserve, extra, monkeypatch):
    monkeypatch.delenv("TREEPAGE_DEBUG_NARROW_ROWS", raising=False)
    args = spec(*cfg)
    assert get_alloc_len_per_decode(args) == alloc_len
    assert get_alloc_reserve_per_decode(args) == reserve
    assert get_row_width_extra(args) == extra
    assert get_row_width(8192, args) == 8192 + extra
    # the row always holds committed + reserve, page-rounded, for any committed <= context_len
    P = cfg[0]
    for committed in (0, 1, 8191, 8192):
        assert next_alloc_target(0, committed, reserve, P) <= 8192 + extra


def test_v1_reserve_is_one_alloc_len_but_rows_stay_wide(monkeypatch):
    monkeypatch.delenv("TREEPAGE_DEBUG_NARROW_ROWS", raising=False)
    args = spec(64, 8, 3, 16)
    assert get_alloc_reserve_per_decode(args, overlap=False) == 1024
    assert get_alloc_reserve_per_decode(spec(64, 8, 3, 16, disable_overlap_schedule=True)) == 1024
    assert get_row_width_extra(spec(64, 8, 3, 16, disable_overlap_schedule=True)) == 2111


@pytest.mark.parametrize("algo", [None, "NONE", "none"])
def test_no_speculation(algo):
    args = Args(speculative_algorithm=algo, page_size=64)
    assert not speculation_enabled(args)
    assert get_alloc_len_per_decode(args) == 1
    assert get_alloc_reserve_per_decode(args) == 1
    assert get_row_width_extra(args) == 4
    assert get_row_width(100, args) == 104


def test_narrow_rows_debug_env(monkeypatch):
    monkeypatch.setenv("TREEPAGE_DEBUG_NARROW_ROWS", "1")
    assert get_row_width_extra(spec(64, 8, 3, 16)) == 20
    assert get_row_width_extra(Args(speculative_algorithm=None)) == 4
    monkeypatch.setenv("TREEPAGE_DEBUG_NARROW_ROWS", "0")
    assert get_row_width_extra(spec(64, 8, 3, 16)) == 2111


def test_alloc_len_covers_verify_window():
    # N dominates when the tree is bigger than the draft branches
    assert get_alloc_len_per_decode(spec(1, 2, 2, 5)) == 5
    assert get_alloc_len_per_decode(spec(2, 2, 1, 5)) == 5  # nnp_max=1: 1*2*2 = 4 < 5
    assert get_alloc_len_per_decode(spec(2, 3, 8, 5)) == 30  # nnp_max = ceil(9/2) = 5


def test_small_helpers():
    assert ceil_div(7, 2) == 4 and ceil_div(8, 2) == 4 and ceil_div(0, 4) == 0
    assert ceil_to_page(65, 64) == 128 and ceil_to_page(64, 64) == 64 and ceil_to_page(5, 1) == 5
    assert next_alloc_target(allocated=300, committed=10, reserve=8, page_size=16) == 300
    assert next_alloc_target(allocated=17, committed=10, reserve=8, page_size=16) == 32
