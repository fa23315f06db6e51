"""Plain (non-speculative) worker: prefill and one-token decode forwards of the target model."""

from __future__ import annotations

from treepage.core import Req, StepOutput
from treepage.layers.forward_batch import ForwardMode
from treepage.layers.sampler import sample
from treepage.model_executor.model_runner import ForwardOutput, ModelRunner
from treepage.model_executor.worker import Worker


class TpWorker(Worker):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.pools = runner.pools

    def prefill(self, reqs: list[Req]) -> list[StepOutput]:
        fb = self.runner.extend_batch([r.row for r in reqs], [r.all_ids() for r in reqs], [0] * len(reqs))
        return self._sample(reqs, self.runner.forward(fb), [r.seq_len for r in reqs])

    def decode(self, reqs: list[Req]) -> list[StepOutput]:
        lens = [r.seq_len for r in reqs]
        fb = self.runner.extend_batch(
            [r.row for r in reqs], [[r.output_ids[-1]] for r in reqs], [n - 1 for n in lens], ForwardMode.DECODE
        )
        return self._sample(reqs, self.runner.forward(fb), lens)

    def release(self, rids: list[str]) -> None:
        """Nothing is kept between steps."""

    def drain(self) -> None:
        """Steps are synchronous."""

    def _sample(self, reqs: list[Req], out: ForwardOutput, committed: list[int]) -> list[StepOutput]:
        assert out.logits is not None
        toks = sample(out.logits, [r.sampling for r in reqs], [r.generator for r in reqs]).tolist()
        return [StepOutput([t], n) for t, n in zip(toks, committed)]
