"""The scheduler <-> worker contract. The scheduler calls the five step and memory methods and nothing else;
the engine calls `close` once the scheduler's loop has stopped.

Memory is the scheduler's: before `prefill` / `decode` it has grown every request's row to cover what the
step may touch (`mem_cache/sizing.py`); a worker writes KV only inside [0, req.allocated_len) of each row.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from treepage.core import Req, StepOutput
from treepage.model_executor.model_runner import ModelRunner, SharedPools


class Worker(ABC):
    runner: ModelRunner  # the target model's
    pools: SharedPools
    overlap: bool = False  # rounds may still run after decode() returns (spec v2): drain() before freeing

    @abstractmethod
    def prefill(self, reqs: list[Req], ends: list[int]) -> list[StepOutput]:
        """Run positions [req.kv_committed_len, end) of each request's ids (prompt and any earlier output). A
        request whose end is its seq_len gets its next token; an earlier end is one chunk of a chunked prefill
        (no token, committed length = end)."""

    @abstractmethod
    def decode(self, reqs: list[Req]) -> list[StepOutput]:
        """One decode step or speculative round for the batch."""

    @abstractmethod
    def release(self, rids: list[str]) -> None:
        """Forget the per-request state of finished, aborted or retracted requests (drains first)."""

    @abstractmethod
    def drain(self) -> None:
        """Wait for any in-flight round; afterwards no forward touches memory until the next call."""

    def model_runners(self) -> list[ModelRunner]:
        """Every model the worker runs, each with its own KV pool."""
        return [self.runner]

    def copy_kv(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the KV of slots `src` into slots `dst` in every pool the worker owns (target and draft): a sample
        of a group takes its sibling's partial prompt page (docs/design.md, "Parallel sampling")."""
        self.drain()  # spec v2: no round runs while the pools are written
        for runner in self.model_runners():
            runner.kv_pool.move_kv_cache(dst, src)

    def close(self) -> None:
        """Free the KV memory of every pool once the scheduler loop has stopped: no call may follow."""
        self.drain()
        for runner in self.model_runners():
            runner.kv_pool.free()
