"""Admission: which waiting requests to prefill now, given pages, rows and the prefill token budget.

A request longer than the chunk size is admitted alone and prefilled in chunks (`Scheduler._run_prefill`), so a
long prompt stalls the running requests' decode for one chunk at a time, not for its whole prefill. The prefix
cache is matched first: the cached whole pages go into the row as they are (locked, shared, never written) and
prefill starts at the first uncached token (docs/design.md, "Prefix cache").

The samples of one prompt (n > 1, docs/design.md "Parallel sampling") are admitted after the first one to be
prefilled: they take its whole prompt pages from the tree and a copy of its partial last page, so each prefills
only its last prompt token (its own first-token logits, its own draft extend).
"""

from __future__ import annotations

from collections import deque

import torch

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
        # (destination, source) slots of the KV a sample copies from its group's donor: the worker copies them
        # in every pool before the prefill (`take_copies`)
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

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
            group = req.group
            fresh = group is not None and not req.output_ids  # a sample not prefilled yet
            n = req.seq_len
            ids = req.all_ids()
            # A hit always leaves at least one token to prefill: the last position's logits give the next token;
            # a request that wants prompt logprobs needs the logits of every position from its first entry on.
            limit = n - 1
            if needs_prompt_logprobs(req):
                limit = min(limit, first_prompt_logit(req))
            donor = self._donor(req, limit, admitted) if fresh else None
            if fresh and donor is None and any(m in admitted for m in group.members):  # type: ignore[union-attr]
                break  # its prompt is being prefilled by a sibling: wait one step and share it
            match = cache.match_prefix(cache.key_of(ids)[:limit], shared=group is not None)
            m = match.num_units(self.page_size)
            start = limit if donor is not None else m  # [m, limit) is copied from the donor
            if admitted and (n - start > budget or self.chunked(n - start)):
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
            if donor is not None and start > m:
                rtt = req_pool.req_to_token
                self._copies.append((rtt[row, m:start].clone(), rtt[donor.row, m:start].clone()))
            waiting.popleft()
            req.row, req.allocated_len, req.kv_committed_len = row, n, start
            req.cache_node, req.cache_len = match.node, m
            if req.cached_tokens is None:
                req.cached_tokens = min(start, len(req.input_ids))
            self.hit_tokens += start
            self.query_tokens += n
            reserved_pages += need
            budget -= n - start
            admitted.append(req)
            if self.chunked(n - start):
                break
        return admitted, too_large

    @staticmethod
    def _donor(req: Req, upto: int, admitted: list[Req]) -> Req | None:
        """A resident sample of the same prompt whose KV of positions [0, upto) is final; None when every other
        sample has finished or is not resident (then `req` prefills what the tree does not hold itself). A sibling
        admitted in the same call is no donor: its KV is not computed (or copied) yet. The samples that do have a
        donor are admitted together, one prefill for all of them."""
        assert req.group is not None
        for other in req.group.members:
            if other is not req and other not in admitted and other.row >= 0 and other.kv_committed_len >= upto:
                return other
        return None

    def take_copies(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (destination, source) slots admitted samples copy from their donors since the last call."""
        if not self._copies:
            return None
        dst = torch.cat([d for d, _ in self._copies])
        src = torch.cat([s for _, s in self._copies])
        self._copies = []
        return dst, src

    def chunked(self, n_tokens: int) -> bool:
        return 0 < self.chunk_size < n_tokens

    def chunk_end(self, r: Req) -> int:
        """Where this step's prefill of `r` stops: its end, or one chunk on."""
        if self.chunk_size <= 0:
            return r.seq_len
        return min(r.seq_len, r.kv_committed_len + self.chunk_size)
