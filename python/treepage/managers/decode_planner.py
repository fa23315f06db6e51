"""Decode memory: grow rows for the next round (row-width check first), pick retraction victims, free rows.

Releasing a row hands its committed whole pages to the prefix cache (mem_cache/radix_cache.py) and frees the
rest: the partial last page, the decode reserve (2x under spec v2), draft-tree and verify slots.
"""

from __future__ import annotations

from treepage.core import Req
from treepage.mem_cache.memory_pool import free_row, write_row_pages
from treepage.mem_cache.radix_cache import RadixCache
from treepage.mem_cache.sizing import (
    RowWidthError,
    ceil_div,
    check_row_width,
    next_alloc_target,
    reserve_decode_slots,
)
from treepage.model_executor.model_runner import SharedPools


class DecodePlanner:
    def __init__(
        self,
        pools: SharedPools,
        reserve: int,
        page_size: int,
        spec_desc: tuple[int, int, int],
        cache: RadixCache,
    ) -> None:
        self.pools = pools
        self.cache = cache
        self.reserve = reserve
        self.page_size = page_size
        self.spec_desc = spec_desc  # (topk, steps, draft tokens) for the row-width error message

    def reserve_round(self, reqs: list[Req]) -> bool:
        """Grow every row for its next round; False (nothing allocated) when pages run out. Raises RowWidthError
        when a round would not fit its row."""
        lens = reserve_decode_slots(
            self.pools.req_to_token_pool,
            self.pools.allocator,
            [r.row for r in reqs],
            [r.allocated_len for r in reqs],
            [r.kv_committed_len for r in reqs],
            self.reserve,
            self.page_size,
            self.spec_desc,
        )
        if lens is None:
            return False
        for r, n in zip(reqs, lens):
            r.allocated_len = n
        return True

    def pages_needed(self, reqs: list[Req]) -> int:
        """Pages the next round's reservation would take from the allocator."""
        P = self.page_size
        return sum(
            ceil_div(next_alloc_target(r.allocated_len, r.kv_committed_len, self.reserve, P), P)
            - ceil_div(r.allocated_len, P)
            for r in reqs
        )

    def overflowing(self, reqs: list[Req]) -> list[tuple[Req, str]]:
        """The requests whose next round would not fit their row, with the reason."""
        bad = []
        for r in reqs:
            nxt = next_alloc_target(r.allocated_len, r.kv_committed_len, self.reserve, self.page_size)
            try:
                check_row_width([nxt], self.pools.req_to_token_pool.row_width, self.page_size, *self.spec_desc)
            except RowWidthError as err:
                bad.append((r, str(err)))
        return bad

    @staticmethod
    def pick_victim(running: list[Req]) -> Req:
        """The newest request is retracted first: it has the least work to redo."""
        return max(running, key=lambda r: r.created)

    def cache_prefix(self, r: Req, shared: bool = False) -> None:
        """At a chunk boundary, or after the prompt of a sample group (`shared`, also with the cache disabled):
        put the committed whole pages in the tree now, so requests sharing the prompt hit them before this one
        finishes. The row then points at the tree's pages (a copy another request cached first was freed by
        `insert`) and this request locks them instead of its old, shorter path."""
        cache, pool, P = self.cache, self.pools.req_to_token_pool, self.page_size
        if (cache.disabled and not shared) or r.row < 0:
            return
        ids = r.all_ids()
        n = cache.cacheable_len(ids, r.kv_committed_len)
        if n <= r.cache_len:
            return
        key = cache.key_of(ids)[:n]
        cache.insert(key, (pool.req_to_token[r.row, :n:P] // P).tolist(), shared=shared)
        match = cache.match_prefix(key, shared=shared)
        assert len(match.pages) * P == n, "the tree holds what was just inserted"
        cache.lock(match.node)
        if r.cache_node is not None:
            cache.unlock(r.cache_node)
        write_row_pages(pool.req_to_token, r.row, match.pages, P)
        r.cache_node, r.cache_len = match.node, n

    def release(self, r: Req, cache: bool = True) -> None:
        """Free the row. With `cache`, its committed whole pages go to the prefix cache first: only the request's
        tokens whose KV is final, never the reserve or speculative slots (the worker was drained before this)."""
        pool = self.pools.req_to_token_pool
        if r.row >= 0:
            start = r.cache_len  # [0, cache_len) are the tree's pages, locked by this request
            if cache and not self.cache.disabled:
                ids = r.all_ids()
                n = self.cache.cacheable_len(ids, r.kv_committed_len)
                if n > start:
                    pages = (pool.req_to_token[r.row, :n : self.page_size] // self.page_size).tolist()
                    self.cache.insert(self.cache.key_of(ids)[:n], pages)
                    start = n
            free_row(pool, self.pools.allocator, r.row, start, r.allocated_len)
            pool.free(r.row)
        if r.cache_node is not None:
            self.cache.unlock(r.cache_node)
        r.row, r.allocated_len, r.kv_committed_len = -1, 0, 0
        r.cache_node, r.cache_len = None, 0
