"""Plain (non-speculative) worker: builds prefill and decode forwards for the target model."""

from __future__ import annotations

import torch

from treepage.layers.sampler import sample
from treepage.managers.schedule_batch import Req
from treepage.model_executor.forward_batch import ForwardMode
from treepage.model_executor.model_runner import ModelRunner


class TpWorker:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.pools = runner.pools
        self.device = runner.device

    # Hooks the scheduler calls; the speculative workers override them.
    def idle(self) -> None: ...

    def forget(self, rids: list[str]) -> None: ...

    def extra_pages_held(self) -> int:
        return 0

    def extra_rows_held(self) -> int:
        return 0

    def committed_len_for_alloc(self, r: Req) -> int:
        return r.seq_len - 1

    def _tensor(self, data) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.int64, device=self.device)

    def extend_batch(
        self, reqs: list[Req], ids: list[list[int]], prefix_lens: list[int], mode=ForwardMode.EXTEND
    ):
        """A forward over new tokens `ids[i]` at positions prefix_lens[i].. of each request's row."""
        rtt = self.pools.req_to_token_pool.req_to_token
        flat_ids, positions, rows = [], [], []
        for r, toks, p in zip(reqs, ids, prefix_lens):
            flat_ids += toks
            positions += range(p, p + len(toks))
            rows += [r.row] * len(toks)
        pos = self._tensor(positions)
        out_loc = rtt[self._tensor(rows), pos]
        ext = [len(t) for t in ids]
        last = torch.tensor(ext, device=self.device).cumsum(0) - 1
        return self.runner.make_batch(
            mode=mode,
            input_ids=self._tensor(flat_ids),
            positions=pos,
            out_cache_loc=out_loc,
            req_rows=self._tensor([r.row for r in reqs]),
            prefix_lens=self._tensor(prefix_lens),
            extend_lens=self._tensor(ext),
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=ext,
            logits_indices=last,
        )

    def prefill(self, reqs: list[Req]) -> list[list[int]]:
        fb = self.extend_batch(reqs, [r.all_ids() for r in reqs], [0] * len(reqs))
        _, logits = self.runner.forward(fb)
        for r in reqs:
            r.kv_committed_len = r.seq_len
        return self._sample(reqs, logits)

    def decode(self, reqs: list[Req]) -> list[list[int]]:
        lens = [r.seq_len for r in reqs]
        fb = self.extend_batch(
            reqs, [[r.output_ids[-1]] for r in reqs], [n - 1 for n in lens], ForwardMode.DECODE
        )
        _, logits = self.runner.forward(fb)
        for r, n in zip(reqs, lens):
            r.kv_committed_len = n
        return self._sample(reqs, logits)

    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> list[list[int]]:
        toks = sample(logits, [r.sampling for r in reqs], [r.generator for r in reqs])
        return [[t] for t in toks.tolist()]
