"""Spec v2: overlap scheduling. Round r+1 is queued on a forward thread before round r's result is known.

The scheduler therefore allocates round r+1 from a committed length that lags by up to one verify; the 2x
reserve of get_alloc_reserve_per_decode absorbs that lag (DESIGN §3). Rounds run strictly in order on one
forward thread, each reading the per-request state the previous round left. Whenever the batch changes
(a request finishes, is aborted or retracted, or new ones are prefilled) the pipeline is drained first, so
no memory is freed or reused under a round that is still running.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from treepage.managers.schedule_batch import Req
from treepage.speculative.eagle_worker import EagleWorker, RoundResult


class EagleWorkerV2(EagleWorker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treepage-forward")
        self.inflight: tuple[list[Req], Future] | None = None
        self.pending: dict[str, list[int]] = {}  # results drained but not yet handed to the scheduler

    def _drain(self) -> None:
        if self.inflight is None:
            return
        reqs, fut = self.inflight
        self.inflight = None
        res: RoundResult = fut.result()
        for r, toks, n in zip(reqs, res.tokens, res.committed):
            r.kv_committed_len = n
            self.pending[r.rid] = toks

    def decode(self, reqs: list[Req]) -> list[list[int]]:
        if self.pending or (
            self.inflight is not None and [r.rid for r in self.inflight[0]] != [r.rid for r in reqs]
        ):
            self._drain()
            return [self.pending.pop(r.rid, []) for r in reqs]
        fut = self.executor.submit(self.run_round, list(reqs), [r.allocated_len for r in reqs])
        prev, self.inflight = self.inflight, (list(reqs), fut)
        if prev is None:
            return [[] for _ in reqs]  # the first round of a pipeline: its tokens arrive with the next call
        prev_reqs, prev_fut = prev
        res: RoundResult = prev_fut.result()
        for r, n in zip(prev_reqs, res.committed):
            r.kv_committed_len = n
        return res.tokens

    def prefill(self, reqs: list[Req]) -> list[list[int]]:
        self._drain()
        return super().prefill(reqs)

    def forget(self, rids: list[str]) -> None:
        self._drain()
        for rid in rids:
            self.pending.pop(rid, None)
        super().forget(rids)

    def idle(self) -> None:
        self._drain()

    def has_pending(self) -> bool:
        return bool(self.pending) or self.inflight is not None
