"""Admission: which waiting requests to prefill now, given pages, rows and the prefill token budget.

A request longer than the chunk size is admitted alone and prefilled in chunks (`Scheduler._run_prefill`), so a
long prompt stalls the running requests' decode for one chunk at a time, not for its whole prefill.
"""

from __future__ import annotations

from collections import deque

from treepage.core import Req
from treepage.mem_cache.memory_pool import grow_row
from treepage.mem_cache.sizing import ceil_div
from treepage.model_executor.model_runner import SharedPools


class Admission:
    def __init__(
        self, pools: SharedPools, reserve: int, page_size: int, max_prefill_tokens: int, chunk_size: int
    ) -> None:
        self.pools = pools
        self.reserve = reserve  # KV one decode round may need beyond the committed length
        self.page_size = page_size
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size  # -1: never chunk

    def pages_for(self, n_tokens: int) -> int:
        return ceil_div(n_tokens, self.page_size)

    def admit(
        self, waiting: deque[Req], num_running: int, max_running: int
    ) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(admitted, too_large with the reason). Admitted requests leave `waiting` with a row that holds their prompt; a request
        that cannot fit even in an empty pool leaves it as too_large. Keeps every running request's next round
        reserved."""
        allocator, req_pool = self.pools.allocator, self.pools.req_to_token_pool
        admitted: list[Req] = []
        too_large: list[tuple[Req, str]] = []
        budget = self.max_prefill_tokens
        reserved_pages = (self.pages_for(self.reserve) + 1) * num_running
        while waiting and num_running + len(admitted) < max_running:
            req = waiting[0]
            n = req.seq_len
            if admitted and (n > budget or self.chunked(n)):
                break
            need = self.pages_for(n + self.reserve) + 1
            if need + reserved_pages > allocator.num_free_pages():
                if num_running == 0 and not admitted:
                    msg = f"the request needs {need} KV pages but the pool has {allocator.num_pages}; "
                    too_large.append((waiting.popleft(), msg + "raise --max-total-tokens"))
                    continue
                break
            row = req_pool.alloc()
            if row is None:
                break
            if not grow_row(req_pool, allocator, row, 0, n):
                req_pool.free(row)
                break
            waiting.popleft()
            req.row, req.allocated_len, req.kv_committed_len = row, n, 0
            reserved_pages += need
            budget -= n
            admitted.append(req)
            if self.chunked(n):
                break
        return admitted, too_large

    def chunked(self, n_tokens: int) -> bool:
        return 0 < self.chunk_size < n_tokens

    def chunk_end(self, r: Req) -> int:
        """Where this step's prefill of `r` stops: its end, or one chunk on."""
        if self.chunk_size <= 0:
            return r.seq_len
        return min(r.seq_len, r.kv_committed_len + self.chunk_size)
