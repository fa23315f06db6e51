"""Spec v2: overlap scheduling. Round r+1 is queued on a forward thread before round r's result is known.

The scheduler therefore allocates round r+1 from a committed length that lags by up to one verify; the 2x
reserve of mem_cache/sizing.py absorbs that lag (docs/design.md, "Memory model"). Rounds run strictly in order
on one forward thread, each reading the per-request state the previous round left; each submission carries its
round's shape, chosen on the scheduler thread (adaptive speculation); an OFF round, a plain decode, runs on the
scheduler thread instead, as the plain worker's does (_decode_off_inline). Whenever the batch changes
(a request finishes, is aborted or retracted, or new ones are prefilled) the pipeline is drained first, so no
memory is freed or reused under a round that is still running.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from treepage.core import Req, StepOutput
from treepage.model_executor.model_runner import ModelRunner
from treepage.server_args import ServerArgs
from treepage.speculative.adaptive import OFF, TreeShape
from treepage.speculative.eagle_worker import EagleWorker, RoundTime


@dataclass
class _Inflight:
    rids: list[str]
    shape: TreeShape
    future: Future[tuple[list[StepOutput], RoundTime]]


class EagleWorkerV2(EagleWorker):
    overlap = True

    def __init__(self, args: ServerArgs, target: ModelRunner, draft: ModelRunner) -> None:
        super().__init__(args, target, draft)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treepage-forward")
        self.inflight: _Inflight | None = None
        self.pending: dict[str, StepOutput] = {}  # results drained but not yet handed to the scheduler

    def drain(self) -> None:
        if self.inflight is None:
            return
        done, self.inflight = self.inflight, None
        self.clock.reset()
        outs, timing = done.future.result()
        self.observe(done.shape, outs, timing)
        self.pending.update(zip(done.rids, outs))

    def close(self) -> None:
        self.executor.shutdown()  # waits for an in-flight round, so none runs while the pools are freed
        super().close()

    def decode(self, reqs: list[Req]) -> list[StepOutput]:
        rids = [r.rid for r in reqs]
        if self.pending or (self.inflight is not None and self.inflight.rids != rids):
            self.drain()
            empty = [StepOutput([], r.kv_committed_len) for r in reqs]  # new since the drained round
            return [self.pending.pop(r.rid, e) for r, e in zip(reqs, empty)]
        shape = self.next_shape(reqs)
        if shape.is_off:
            return self._decode_off_inline(reqs)
        fut = self.executor.submit(self.timed_round, list(reqs), [r.allocated_len for r in reqs], shape)
        prev, self.inflight = self.inflight, _Inflight(rids, shape, fut)
        if prev is None:  # the first round of a pipeline: its tokens arrive with the next call
            self.clock.lap(rids)
            return [StepOutput([], r.kv_committed_len) for r in reqs]
        outs, timing = prev.future.result()
        self.observe(prev.shape, outs, timing, self.clock.lap(rids))  # lap: the pipeline's period
        return outs

    def _decode_off_inline(self, reqs: list[Req]) -> list[StepOutput]:
        """An OFF round runs on the scheduler thread, as the plain worker's decode does: a plain decode gains nothing
        from the overlap on a few CPU cores, where the forward thread competes with the scheduler's own work for
        them (docs/design.md "Adaptive speculation"). A round still in flight hands back its tokens now and
        the OFF round's wait for the next call, so each call returns one round, in order."""
        prev, self.inflight = self.inflight, None
        if prev is not None:  # its state is this round's input: wait for it first
            self.clock.reset()  # this call runs two rounds: no lap for either
            prev_outs, prev_timing = prev.future.result()
            self.observe(prev.shape, prev_outs, prev_timing)
        outs, timing = self.timed_round(reqs, [r.allocated_len for r in reqs], OFF)
        self.observe(OFF, outs, timing, self.clock.lap([r.rid for r in reqs]))
        if prev is None:
            return outs
        self.pending.update(zip(prev.rids, outs))
        return prev_outs

    def prefill(self, reqs: list[Req], ends: list[int]) -> list[StepOutput]:
        self.drain()
        return super().prefill(reqs, ends)

    def release(self, rids: list[str]) -> None:
        self.drain()
        for rid in rids:
            self.pending.pop(rid, None)
        super().release(rids)
