"""Decode memory: grow rows for the next round (row-width check first), pick retraction victims, free rows."""

from __future__ import annotations

from treepage.core import Req
from treepage.mem_cache.memory_pool import free_row
from treepage.mem_cache.sizing import RowWidthError, check_row_width, next_alloc_target, reserve_decode_slots
from treepage.model_executor.model_runner import SharedPools


class DecodePlanner:
    def __init__(self, pools: SharedPools, reserve: int, page_size: int, spec_desc: tuple[int, int, int]):
        self.pools = pools
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

    def release(self, r: Req) -> None:
        if r.row >= 0:
            free_row(self.pools.req_to_token_pool, self.pools.allocator, r.row, 0, r.allocated_len)
            self.pools.req_to_token_pool.free(r.row)
        r.row, r.allocated_len, r.kv_committed_len = -1, 0, 0
