"""Spec v2: overlap scheduling. Round r+1 is queued on a forward thread before round r's result is known.

The scheduler therefore allocates round r+1 from a committed length that lags by up to one verify; the 2x
reserve of mem_cache/sizing.py absorbs that lag (docs/design.md, "Memory model"). Rounds run strictly in order
on one forward thread, each reading the per-request state the previous round left. Whenever the batch changes
(a request finishes, is aborted or retracted, or new ones are prefilled) the pipeline is drained first, so no
memory is freed or reused under a round that is still running.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from treepage.core import Req, StepOutput
from treepage.model_executor.model_runner import ModelRunner
from treepage.server_args import ServerArgs
from treepage.speculative.eagle_worker import EagleWorker


class EagleWorkerV2(EagleWorker):
    overlap = True

    def __init__(self, args: ServerArgs, target: ModelRunner, draft: ModelRunner) -> None:
        super().__init__(args, target, draft)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treepage-forward")
        self.inflight: tuple[list[str], Future[list[StepOutput]]] | None = None
        self.pending: dict[str, StepOutput] = {}  # results drained but not yet handed to the scheduler

    def drain(self) -> None:
        if self.inflight is None:
            return
        rids, fut = self.inflight
        self.inflight = None
        self.pending.update(zip(rids, fut.result()))

    def decode(self, reqs: list[Req]) -> list[StepOutput]:
        rids = [r.rid for r in reqs]
        if self.pending or (self.inflight is not None and self.inflight[0] != rids):
            self.drain()
            empty = [StepOutput([], r.kv_committed_len) for r in reqs]  # new since the drained round
            return [self.pending.pop(r.rid, e) for r, e in zip(reqs, empty)]
        fut = self.executor.submit(self.run_round, list(reqs), [r.allocated_len for r in reqs])
        prev, self.inflight = self.inflight, (rids, fut)
        if prev is None:  # the first round of a pipeline: its tokens arrive with the next call
            return [StepOutput([], r.kv_committed_len) for r in reqs]
        return prev[1].result()

    def prefill(self, reqs: list[Req], ends: list[int]) -> list[StepOutput]:
        self.drain()
        return super().prefill(reqs, ends)

    def release(self, rids: list[str]) -> None:
        self.drain()
        for rid in rids:
            self.pending.pop(rid, None)
        super().release(rids)
