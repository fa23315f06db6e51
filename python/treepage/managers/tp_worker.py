"""Plain (non-speculative) worker: prefill and one-token decode forwards of the target model."""

from __future__ import annotations

from treepage.core import Req, StepOutput
from treepage.layers import logits_processor
from treepage.layers.forward_batch import ForwardMode
from treepage.layers.sampler import sample_last, sample_reqs
from treepage.model_executor.model_runner import ModelRunner
from treepage.model_executor.worker import Worker


class TpWorker(Worker):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.pools = runner.pools

    def prefill(self, reqs: list[Req], ends: list[int]) -> list[StepOutput]:
        starts = [r.kv_committed_len for r in reqs]
        ids = [r.all_ids()[a:e] for r, a, e in zip(reqs, starts, ends)]
        out = self.runner.forward(self.runner.extend_batch([r.row for r in reqs], ids, starts))
        assert out.logits is not None
        logits_processor.sync(reqs)
        toks = sample_last(out.logits, reqs, ends)
        logits_processor.commit(reqs, [[t] if t is not None else [] for t in toks])
        return [StepOutput([t] if t is not None else [], e) for t, e in zip(toks, ends)]

    def decode(self, reqs: list[Req]) -> list[StepOutput]:
        lens = [r.seq_len for r in reqs]
        fb = self.runner.extend_batch(
            [r.row for r in reqs], [[r.output_ids[-1]] for r in reqs], [n - 1 for n in lens], ForwardMode.DECODE
        )
        out = self.runner.forward(fb)
        assert out.logits is not None
        toks = sample_reqs(out.logits, reqs)
        logits_processor.commit(reqs, [[t] for t in toks])
        return [StepOutput([t], n) for t, n in zip(toks, lens)]

    def release(self, rids: list[str]) -> None:
        """Nothing is kept between steps."""

    def drain(self) -> None:
        """Steps are synchronous."""

