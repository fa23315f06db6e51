"""Admission: which waiting requests to prefill now, given pages, rows and the prefill token budget.

A request longer than the chunk size is admitted alone and prefilled in chunks (`Scheduler._run_prefill`), so a
long prompt stalls the running requests' decode for one chunk at a time, not for its whole prefill. The prefix
cache is matched first: the cached whole pages go into the row as they are (locked, shared, never written) and
prefill starts at the first uncached token (docs/design.md, "Prefix cache").
"""

from __future__ import annotations

from collections import deque

from treepage.core import Req
from treepage.layers.logprobs import first_prompt_logit, needs_prompt_logprobs
from treepage.mem_cache.memory_pool import grow_row, write_row_pages
from treepage.mem_cache.radix_cache import RadixCache
from treepage.mem_cache.sizing import ceil_div
from treepage.model_executor.model_runner import SharedPools


class Admission:
    def __init__(
        self,
        pools: SharedPools,
        reserve: int,
        page_size: int,
        max_prefill_tokens: int,
        chunk_size: int,
        cache: RadixCache,
    ) -> None:
        self.pools = pools
        self.reserve = reserve  # KV one decode round may need beyond the committed length
        self.page_size = page_size
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size  # -1: never chunk
        self.cache = cache
        self.hit_tokens = 0  # prefix-cache statistics over all admissions (/metrics)
        self.query_tokens = 0

    def pages_for(self, n_tokens: int) -> int:
        return ceil_div(n_tokens, self.page_size)

    def admit(
        self, waiting: deque[Req], num_running: int, max_running: int
    ) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(admitted, too_large with the reason). Admitted requests leave `waiting` with a row that holds their prompt; a request
        that cannot fit even in an empty pool leaves it as too_large. Keeps every running request's next round
        reserved; evicts unlocked cache pages to make room."""
        allocator, req_pool, cache = self.pools.allocator, self.pools.req_to_token_pool, self.cache
        admitted: list[Req] = []
        too_large: list[tuple[Req, str]] = []
        budget = self.max_prefill_tokens
        reserved_pages = (self.pages_for(self.reserve) + 1) * num_running
        while waiting and num_running + len(admitted) < max_running:
            req = waiting[0]
            n = req.seq_len
            ids = req.all_ids()
            # A hit always leaves at least one token to prefill: the last position's logits give the next token;
            # a request that wants prompt logprobs needs the logits of every position from its first entry on.
            limit = n - 1
            if needs_prompt_logprobs(req):
                limit = min(limit, first_prompt_logit(req))
            match = cache.match_prefix(cache.key_of(ids)[:limit])
            m = match.num_units(self.page_size)
            if admitted and (n - m > budget or self.chunked(n - m)):
                break
            cache.lock(match.node)
            need = self.pages_for(n + self.reserve) + 1 - len(match.pages)
            short = need + reserved_pages - allocator.num_free_pages()
            if short > 0:
                cache.evict(short)
            if need + reserved_pages > allocator.num_free_pages():
                cache.unlock(match.node)
                if num_running == 0 and not admitted:
                    msg = f"the request needs {need} KV pages but the pool has {allocator.num_pages}; "
                    too_large.append((waiting.popleft(), msg + "raise --max-total-tokens"))
                    continue
                break
            row = req_pool.alloc()
            if row is None:
                cache.unlock(match.node)
                break
            write_row_pages(req_pool.req_to_token, row, match.pages, self.page_size)
            ok = grow_row(req_pool, allocator, row, m, n)
            assert ok, "pages were counted above"
            waiting.popleft()
            req.row, req.allocated_len, req.kv_committed_len = row, n, m
            req.cache_node, req.cache_len = match.node, m
            if req.cached_tokens is None:
                req.cached_tokens = min(m, len(req.input_ids))
            self.hit_tokens += m
            self.query_tokens += n
            reserved_pages += need
            budget -= n - m
            admitted.append(req)
            if self.chunked(n - m):
                break
        return admitted, too_large

    def chunked(self, n_tokens: int) -> bool:
        return 0 < self.chunk_size < n_tokens

    def chunk_end(self, r: Req) -> int:
        """Where this step's prefill of `r` stops: its end, or one chunk on."""
        if self.chunk_size <= 0:
            return r.seq_len
        return min(r.seq_len, r.kv_committed_len + self.chunk_size)
