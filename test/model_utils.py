"""Model-level helpers shared by tests: logits through the engine's own runner on a paged row."""

from __future__ import annotations

import torch

from treepage.entrypoints.engine import Engine
from treepage.layers.forward_batch import ForwardMode
from treepage.mem_cache.memory_pool import free_row, grow_row


def runner_logits(engine: Engine, ids: list[int], n_decode: int = 3) -> torch.Tensor:
    """Logits at every position of `ids` from three kinds of forward on one paged row: a prefill of the first
    part, an extend on top of that cached prefix, then `n_decode` single-token decodes.

    Call on an engine whose scheduler is stopped: the row and pages are taken from its pools directly.
    """
    w = engine.worker
    pools = w.pools
    a, b = len(ids) // 3, len(ids) - n_decode
    assert 0 < a < b < len(ids)
    row = pools.req_to_token_pool.alloc()
    assert row is not None and grow_row(pools.req_to_token_pool, pools.allocator, row, 0, len(ids))
    chunks = [(0, a, ForwardMode.EXTEND), (a, b, ForwardMode.EXTEND)]
    chunks += [(p, p + 1, ForwardMode.DECODE) for p in range(b, len(ids))]
    parts = []
    try:
        for start, end, mode in chunks:
            fb = engine.runner.extend_batch([row], [ids[start:end]], [start], mode)
            fb.logits_indices = None  # logits for every new token, not only the last
            logits = engine.runner.forward(fb).logits
            assert logits is not None
            assert logits.shape == (end - start, engine.vocab_size)
            parts.append(logits.float())
    finally:
        free_row(pools.req_to_token_pool, pools.allocator, row, 0, len(ids))
        pools.req_to_token_pool.free(row)
    pools.allocator.check_leak(
        expected_used=engine.scheduler.cache.num_pages
    )  # earlier requests' cached pages
    pools.req_to_token_pool.check_leak(expected_used=0)
    return torch.cat(parts)
