"""The sampling parameters that adjust logits: repetition / frequency / presence penalties, logit_bias and
min_new_tokens, as path-aware RequestLogitsProcessors (layers/logits_processor.py).

Each processor holds its request's accepted output incrementally (counts updated by `accept`, never recounted)
and adjusts all R rows a request has in one call with a few tensor ops: a tree-verify row's history is the
accepted output + the row's path, so its counts are the accepted counts plus its path's tokens.

Semantics, in the order applied (the penalties, then the bias, so a bias is never scaled, then the mask):
- `repetition_penalty` (HF / SGLang, > 0): a token already in the output has its logit divided by the penalty
  when positive and multiplied when negative. As in SGLang, only output tokens count, not the prompt.
- `frequency_penalty`, `presence_penalty` (OpenAI, [-2, 2]): logit -= frequency * count + presence * (count > 0),
  counted over the output.
- `logit_bias` (OpenAI): a fixed additive bias per token id.
- `min_new_tokens` (SGLang): the tokens that would stop the request (EOS and `stop_token_ids`) get -inf while the
  output is shorter. Stop strings are not masked, as in SGLang; with `ignore_eos` nothing is masked (nothing the
  mask could hold back stops the request).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from treepage.core import SamplingParams
from treepage.layers.logits_processor import LogitsProcessorChain, RequestLogitsProcessor


class OutputPenalties(RequestLogitsProcessor):
    """repetition_penalty, frequency_penalty and presence_penalty: they share one count of the output tokens.

    Only the columns of tokens some row has seen change, so the work is R x (distinct tokens seen), not R x V."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        repetition: float = 1.0,
        frequency: float = 0.0,
        presence: float = 0.0,
    ) -> None:
        self.repetition, self.frequency, self.presence = repetition, frequency, presence
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.seen: set[int] = set()  # the token ids with a nonzero count

    def accept(self, tokens: Sequence[int]) -> None:
        idx = torch.tensor(list(tokens), dtype=torch.int64, device=self.counts.device)
        self.counts.index_add_(0, idx, torch.ones(len(idx), dtype=torch.float32, device=idx.device))
        self.seen.update(tokens)

    def reset(self) -> None:
        self.counts.zero_()
        self.seen.clear()

    def columns(self, paths: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor] | None:
        """(ids [U], counts [R, U]): the tokens any row has seen and their count as each row sees it ([1, U],
        shared, when no row has a path); None when no row has seen any token."""
        ids = sorted(self.seen.union(*paths))
        if not ids:
            return None
        dev = self.counts.device
        cols = torch.tensor(ids, dtype=torch.int64, device=dev)
        counts = self.counts[cols][None]
        width = max((len(p) for p in paths), default=0)
        if width:
            at = {t: j for j, t in enumerate(ids)}
            idx = torch.tensor([[at[t] for t in p] + [0] * (width - len(p)) for p in paths], device=dev)
            ones = torch.tensor([[1.0] * len(p) + [0.0] * (width - len(p)) for p in paths], device=dev)
            counts = counts.repeat(len(paths), 1).scatter_add_(1, idx, ones)
        return cols, counts

    def apply(self, logits: Tensor, paths: Sequence[Sequence[int]]) -> None:
        found = self.columns(paths)
        if found is None:
            return
        cols, counts = found
        sub = logits[:, cols]  # a copy: written back below
        seen = counts > 0
        if self.repetition != 1.0:
            scaled = torch.where(sub < 0, sub * self.repetition, sub / self.repetition)
            sub = torch.where(seen, scaled, sub)
        if self.frequency != 0.0:
            sub = sub - counts * self.frequency
        if self.presence != 0.0:
            sub = sub - seen.float() * self.presence
        logits[:, cols] = sub


class LogitBias(RequestLogitsProcessor):
    """OpenAI's logit_bias: independent of the history, so it keeps no state."""

    def __init__(self, bias: dict[int, float], device: torch.device | str) -> None:
        self.ids = torch.tensor(sorted(bias), dtype=torch.int64, device=device)
        self.values = torch.tensor([bias[t] for t in sorted(bias)], dtype=torch.float32, device=device)

    def apply(self, logits: Tensor, paths: Sequence[Sequence[int]]) -> None:
        logits.index_add_(1, self.ids, self.values.expand(logits.shape[0], -1))

    def accept(self, tokens: Sequence[int]) -> None:
        """The bias does not depend on the output."""

    def reset(self) -> None:
        """Nothing to forget."""


class MinNewTokens(RequestLogitsProcessor):
    """SGLang's min_new_tokens: the stop tokens are masked in every row whose history is still too short."""

    def __init__(self, min_new_tokens: int, stop_ids: Iterable[int], device: torch.device | str) -> None:
        self.min_new_tokens = min_new_tokens
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.int64, device=device)
        self.accepted = 0

    def accept(self, tokens: Sequence[int]) -> None:
        self.accepted += len(tokens)

    def reset(self) -> None:
        self.accepted = 0

    def apply(self, logits: Tensor, paths: Sequence[Sequence[int]]) -> None:
        short = [i for i, p in enumerate(paths) if self.accepted + len(p) < self.min_new_tokens]
        if not short or not len(self.stop_ids):
            return
        rows = torch.tensor(short, dtype=torch.int64, device=logits.device)
        logits[rows[:, None], self.stop_ids[None, :]] = float("-inf")


def build_chain(
    sp: SamplingParams,
    stop_ids: Iterable[int],
    vocab_size: int,
    device: torch.device | str,
    grammar: RequestLogitsProcessor | None = None,
) -> LogitsProcessorChain | None:
    """A request's processors for its sampling params, or None when every value is neutral (no cost at all).

    `stop_ids`: the token ids that end a request (EOS); the request's own stop_token_ids are added here.
    `grammar` (layers/grammar.py) comes last: its mask has the final word over any penalty or bias.
    """
    processors: list[RequestLogitsProcessor] = []
    if sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0:
        processors.append(
            OutputPenalties(vocab_size, device, sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty)
        )
    if sp.logit_bias:
        processors.append(LogitBias(sp.logit_bias, device))
    if sp.min_new_tokens > 0 and not sp.ignore_eos:
        processors.append(MinNewTokens(sp.min_new_tokens, sp.stop_token_set(stop_ids, vocab_size), device))
    if grammar is not None:
        processors.append(grammar)
    return LogitsProcessorChain(processors) if processors else None
