"""Plain (non-speculative) worker: prefill and one-token decode forwards of the target model."""

from __future__ import annotations

from treepage.core import Req, StepOutput
from treepage.layers import logits_processor, logprobs
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
        firsts = logprobs.prefill_logit_starts(reqs, starts, ends)
        out = self.runner.forward(self.runner.extend_batch([r.row for r in reqs], ids, starts, logit_starts=firsts))
        assert out.logits is not None
        last, prompt_lps = logprobs.split_prefill_logits(out.logits, reqs, ends, firsts)
        logits_processor.sync(reqs)
        toks, lps = sample_last(last, reqs, ends)
        logits_processor.commit(reqs, [[t] if t is not None else [] for t in toks])
        return [logprobs.prefill_output(t, e, lp, p) for t, e, lp, p in zip(toks, ends, lps, prompt_lps)]

    def decode(self, reqs: list[Req]) -> list[StepOutput]:
        lens = [r.seq_len for r in reqs]
        fb = self.runner.extend_batch(
            [r.row for r in reqs], [[r.output_ids[-1]] for r in reqs], [n - 1 for n in lens], ForwardMode.DECODE
        )
        out = self.runner.forward(fb)
        assert out.logits is not None
        toks, lps = sample_reqs(out.logits, reqs)
        logits_processor.commit(reqs, [[t] for t in toks])
        return [StepOutput([t], n, logprobs=[lp] if lp else None) for t, n, lp in zip(toks, lens, lps)]

    def release(self, rids: list[str]) -> None:
        """Nothing is kept between steps."""

    def drain(self) -> None:
        """Steps are synchronous."""

