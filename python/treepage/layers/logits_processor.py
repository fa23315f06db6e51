"""Per-request logits processing that depends on the tokens before each row: penalties, logit_bias, grammar masks.

A row of logits predicts the token after a history: the request's output so far (the tokens its processors have
accepted) followed by the row's *path*. For a plain decode, a prefill's last row or a speculative off round the
path is empty; for a tree-verify row it is the drafted tokens from the root (exclusive) to that node (inclusive),
so each branch is processed as if plain decoding had produced it. Every place that turns logits into tokens runs
the same processors, which is why a penalised or constrained request emits the same tokens with speculation on
or off.

Ownership: the worker that samples a request's tokens is the only writer of its processors' state. It calls
`commit` with the tokens it emits, in emission order (spec v2's forward thread included, whose rounds run in
order), and `sync` before it (re)prefills a request, whose output may have been cut back by a retraction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import Tensor

from treepage.core import Req


class RequestLogitsProcessor(ABC):
    """One adjustment of one request's logits, stateful along the request's output."""

    constrains = False  # True: some tokens are forbidden outright (a grammar), so `allowed` can prune drafts

    @abstractmethod
    def apply(self, logits: Tensor, paths: Sequence[Sequence[int]]) -> None:
        """Adjust fp32 logits [R, V] in place; row i predicts the token after the accepted history + paths[i]."""

    @abstractmethod
    def accept(self, tokens: Sequence[int]) -> None:
        """Extend the accepted history (tokens the request emitted)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the accepted history (back to the state before the first output token)."""

    def allowed(self, paths: Sequence[Sequence[int]]) -> Tensor | None:
        """[R, V] bool: the tokens row i may take after the history + paths[i]; None: no token is forbidden."""
        return None


class LogitsProcessorChain:
    """A request's processors, applied in order, and the output history they have accepted."""

    def __init__(self, processors: Sequence[RequestLogitsProcessor]) -> None:
        self.processors = list(processors)
        self.history: list[int] = []

    def apply(self, logits: Tensor, paths: Sequence[Sequence[int]]) -> None:
        for p in self.processors:
            p.apply(logits, paths)

    @property
    def constrains(self) -> bool:
        return any(p.constrains for p in self.processors)

    def allowed(self, paths: Sequence[Sequence[int]]) -> Tensor | None:
        out: Tensor | None = None
        for p in self.processors:
            a = p.allowed(paths) if p.constrains else None
            if a is not None:
                out = a if out is None else out & a
        return out

    def accept(self, tokens: Sequence[int]) -> None:
        self.history.extend(tokens)
        for p in self.processors:
            p.accept(tokens)

    def sync(self, output_ids: Sequence[int]) -> None:
        """Make the accepted history equal the request's output (replayed from the start when it differs)."""
        if self.history == list(output_ids):
            return
        self.history = []
        for p in self.processors:
            p.reset()
        self.accept(output_ids)


def chain_of(req: Req) -> LogitsProcessorChain | None:
    chain = req.logits_processor
    assert chain is None or isinstance(chain, LogitsProcessorChain)
    return chain


def process_logits(
    logits: Tensor, reqs: Sequence[Req], paths: Sequence[Sequence[Sequence[int]]] | None = None
) -> Tensor:
    """Logits [B * R, V] (R rows per request, in request order) -> the logits tokens are chosen from.

    `paths[b]` gives request b's R row paths (None: one row per request with an empty path). Returns `logits`
    itself when no request has processors (no copy, the common case), else an fp32 copy with each request's
    rows adjusted by its chain.
    """
    chains = [chain_of(r) for r in reqs]
    if all(c is None for c in chains):
        return logits
    rows = logits.shape[0] // max(len(reqs), 1)
    out = logits.float().clone()
    for b, chain in enumerate(chains):
        if chain is not None:
            chain.apply(out[b * rows : (b + 1) * rows], paths[b] if paths is not None else [[]] * rows)
    return out


def constrained(reqs: Sequence[Req]) -> bool:
    """Whether some request forbids tokens outright (a grammar): then draft candidates are pruned."""
    return any(c is not None and c.constrains for c in map(chain_of, reqs))


def allowed_tokens(reqs: Sequence[Req], paths: Sequence[Sequence[Sequence[int]]], vocab_size: int) -> Tensor | None:
    """[B * R, V] bool (R rows per request, row paths as in process_logits): the tokens each row may take; None
    when no request forbids any. Draft pruning reads it (speculative/eagle_worker.py)."""
    out: Tensor | None = None
    rows = len(paths[0]) if paths else 0
    for b, chain in enumerate(map(chain_of, reqs)):
        a = chain.allowed(paths[b]) if chain is not None and chain.constrains else None
        if a is None:
            continue
        if out is None:
            out = torch.ones(len(reqs) * rows, vocab_size, dtype=torch.bool, device=a.device)
        out[b * rows : (b + 1) * rows] = a
    return out


def commit(reqs: Sequence[Req], tokens: Sequence[Sequence[int]]) -> None:
    """Record the tokens each request emitted this step in its processors' history."""
    for r, t in zip(reqs, tokens):
        chain = chain_of(r)
        if chain is not None and t:
            chain.accept(t)


def sync(reqs: Sequence[Req]) -> None:
    """Before a (re)prefill: align each request's processors with its output so far."""
    for r in reqs:
        chain = chain_of(r)
        if chain is not None:
            chain.sync(r.output_ids)
