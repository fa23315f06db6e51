"""Requests and their sampling parameters: the scheduler's plain data."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

_rid_counter = itertools.count()


def new_rid() -> str:
    return f"req-{next(_rid_counter)}"


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError with a message fit for an HTTP 400."""
        if (
            not isinstance(self.max_new_tokens, int)
            or isinstance(self.max_new_tokens, bool)
            or self.max_new_tokens < 0
        ):
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if len(self.stop) > 16:
            raise ValueError("at most 16 stop strings are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError("stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids entry {t} is outside the vocabulary [0, {vocab_size})")


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    message: str | None = None

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            d["matched"] = self.matched
        elif self.type == "length":
            d["length"] = self.matched
        elif self.message:
            d["message"] = self.message
        return d


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    sink: Callable[[dict], None]  # receives cumulative output snapshots (called from the scheduler thread)
    output_ids: list[int] = field(default_factory=list)
    row: int = -1  # req_to_token row, -1 when not resident
    allocated_len: int = 0  # row positions [0, allocated_len) hold slots owned by this request
    kv_committed_len: int = 0  # positions whose target KV is final
    finished: FinishReason | None = None
    aborted: bool = False
    text: str = ""
    generator: torch.Generator | None = None
    created: float = 0.0
    first_token_time: float | None = None
    # Speculative state (per request, between rounds)
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0
    draft_topk_p: torch.Tensor | None = None  # [K]
    draft_topk_index: torch.Tensor | None = None  # [K]
    draft_hidden: torch.Tensor | None = None  # [H]

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids
