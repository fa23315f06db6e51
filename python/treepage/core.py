"""The plain data every layer of the engine shares: a request, its sampling parameters, what a step produced.

Ownership of `Req` fields (one writer each; everyone else only reads):

| field                                   | written by                                             |
|-----------------------------------------|--------------------------------------------------------|
| rid, input_ids, sampling, sink, created, generator, logits_processor, logprob, group | `entrypoints/engine.py` (`Engine.submit`, `Engine.submit_samples`), once |
| row, allocated_len                      | `managers/admission.py` (admit), `managers/decode_planner.py` (reserve, release) |
| cache_node, cache_len, cached_tokens    | `managers/admission.py` (prefix match), `managers/decode_planner.py` (release) |
| kv_committed_len                        | `managers/scheduler.py`, from each `StepOutput`        |
| output_ids, finished, first_token_time, spec_verify_ct, spec_accepted_drafts | `managers/output.py` |
| detok                                   | `managers/output.py` (the request's incremental detokeniser) |
| input_logprobs_len                      | `managers/output.py` (prompt logprob entries accepted so far) |

A worker (`model_executor/worker.py`) reads a request and returns `StepOutput`s; state it keeps between rounds
(a speculative worker's draft state) lives in the worker, keyed by `rid`, never on the request. The one
exception is the state inside `logits_processor` (penalty counts, grammar matchers): the object is set once by
the engine, and its contents are advanced only by the worker that samples the request's tokens
(`layers/logits_processor.py`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

_rid_counter = itertools.count()


def new_rid() -> str:
    return f"req-{next(_rid_counter)}"


class SamplingParamError(ValueError):
    """An invalid sampling parameter; `param` names it (the "param" of the HTTP 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "choice", "structural_tag")  # SGLang's constraint fields
MAX_ABS_PENALTY = 2.0  # OpenAI's range for frequency_penalty and presence_penalty
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value


def parse_logit_bias(raw: Any) -> dict[int, float]:
    """logit_bias as JSON carries it (token-id strings as keys) or as Python does (int keys) -> {id: bias}."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SamplingParamError("logit_bias", "logit_bias must be an object mapping token ids to biases")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key):
            key = int(key)
        if not isinstance(key, int) or isinstance(key, bool):
            raise SamplingParamError("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SamplingParamError("logit_bias", f"logit_bias[{key}] must be a number, got {value!r}")
        out[key] = float(value)
    return out


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
    # layers/penalties.py: applied to the logits in every place tokens are chosen (neutral values cost nothing)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_new_tokens: int = 0
    # layers/grammar.py: at most one constraint (GRAMMAR_FIELDS), compiled by the engine, masked where tokens
    # are chosen and where draft candidates are kept
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    choice: list[str] | None = None
    structural_tag: str | None = None

    @property
    def grammar(self) -> tuple[str, Any] | None:
        """(field, value) of the request's one constraint, or None; SamplingParamError when several are set."""
        given = [f for f in GRAMMAR_FIELDS if getattr(self, f) not in (None, [], "")]
        if len(given) > 1:
            raise SamplingParamError(
                given[0], f"only one of {', '.join(given)} may be set per request (each is a whole constraint)"
            )
        return (given[0], getattr(self, given[0])) if given else None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def stop_token_set(self, eos_ids: Iterable[int], vocab_size: int) -> set[int]:
        """The tokens that end this request: the engine's EOS ids and the request's own stop_token_ids."""
        return {t for t in (*eos_ids, *self.stop_token_ids) if 0 <= t < vocab_size}

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError with a message fit for an HTTP 400 (a SamplingParamError names its field); turns
        logit_bias's JSON string keys into token ids."""
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
        self._validate_penalties(vocab_size)
        _ = self.grammar  # at most one constraint; whether it compiles is the engine's check

    def _validate_penalties(self, vocab_size: int) -> None:
        self.logit_bias = parse_logit_bias(self.logit_bias)  # JSON's string keys become token ids
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_ABS_PENALTY <= v <= MAX_ABS_PENALTY:
                raise SamplingParamError(name, f"{name} must be in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0.0 < rp < float("inf"):
            raise SamplingParamError("repetition_penalty", f"repetition_penalty must be > 0, got {rp!r}")
        for t, b in self.logit_bias.items():
            if not 0 <= t < vocab_size:
                raise SamplingParamError(
                    "logit_bias", f"logit_bias token id {t} is outside the vocabulary [0, {vocab_size})"
                )
            if not -MAX_ABS_LOGIT_BIAS <= b <= MAX_ABS_LOGIT_BIAS:
                raise SamplingParamError("logit_bias", f"logit_bias[{t}] must be in [-100, 100], got {b!r}")
        m = self.min_new_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise SamplingParamError("min_new_tokens", f"min_new_tokens must be a non-negative integer, got {m!r}")
        if m > self.max_new_tokens:
            raise SamplingParamError(
                "min_new_tokens", f"min_new_tokens ({m}) must not exceed max_new_tokens ({self.max_new_tokens})"
            )


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class LogprobParams:
    """What a request asks for besides its tokens' own log-probabilities (set only when it asks at all).

    `start`: first prompt position whose token gets an input logprob entry (-1: output tokens only);
    `top_n`: how many of the most likely tokens to list per position; `token_ids`: ids whose logprobs are listed
    at every position. The distribution is the one `layers/logprobs.py` documents.
    """

    start: int = -1
    top_n: int = 0
    token_ids: tuple[int, ...] = ()

    def invalid_field(self, vocab_size: int, prompt_len: int) -> tuple[str, str] | None:
        """(field, message fit for an HTTP 400) for the first out-of-range value, else None."""
        if self.start != -1 and not 0 <= self.start <= prompt_len:
            return "logprob_start_len", f"must be -1 or in [0, {prompt_len}] (the prompt length), got {self.start}"
        if not 0 <= self.top_n <= vocab_size:
            return "top_logprobs_num", f"must be in [0, {vocab_size}], got {self.top_n}"
        for t in self.token_ids:
            if not 0 <= t < vocab_size:
                return "token_ids_logprob", f"entry {t} is outside the vocabulary [0, {vocab_size})"
        return None


@dataclass
class TokenLogprob:
    """One position: its token's log-probability (None for the first prompt token, which nothing predicts), the
    `top_n` most likely tokens and the requested ids, each as (logprob, token id)."""

    token: int
    logprob: float | None
    top: list[tuple[float, int]] = field(default_factory=list)
    ids: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            d["matched"] = self.matched
        elif self.type == "length":
            d["length"] = self.matched
        elif self.message:
            d["message"] = self.message
        return d


@dataclass
class StepOutput:
    """What a worker hands back for one request after a prefill or a decode round."""

    tokens: list[int]  # new tokens, in order (empty while an overlapped round is still in flight)
    committed_len: int  # positions whose target KV is final once these tokens are appended
    verified: bool = False  # the tokens come from a speculative verify round
    # greedy verify rounds under adaptive speculation: shape label -> the tokens a smaller candidate shape would
    # have emitted from the same draft state (speculative/eagle_verify.subtree_accept_len), the policy's evidence
    # for shapes it did not run
    subtree_accept: dict[str, int] | None = None
    # Only for requests with `Req.logprob` set: one entry per token of `tokens`, and the prompt entries this step
    # computed, for prompt positions input_logprobs_start, input_logprobs_start + 1, ...
    logprobs: list[TokenLogprob] | None = None
    input_logprobs: list[TokenLogprob] | None = None
    input_logprobs_start: int = 0


MAX_SAMPLES = 16  # the largest n (parallel samples of one prompt) a request may ask for


def check_num_samples(n: object) -> None:
    """n (parallel samples of one prompt) must be an integer in [1, MAX_SAMPLES]; the 400 names the field."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SAMPLES:
        raise SamplingParamError("n", f"n must be an integer in [1, {MAX_SAMPLES}], got {n!r}")


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: seed + index (docs/design.md, "Parallel
    sampling"), so sample 0 draws as the same request with n = 1 would."""
    return seed + index


@dataclass(eq=False)
class SampleGroup:
    """The n samples of one prompt (n > 1). The first member to be prefilled computes the prompt; the others are
    admitted after it and share its whole pages through the prefix tree and copy its partial last page
    (`managers/admission.py`). `rid` is the request's own id: aborting it aborts every sample."""

    rid: str
    members: list[Req] = field(default_factory=list, repr=False)


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    sink: Callable[[dict[str, Any]], None]  # receives output deltas (called from the scheduler thread)
    output_ids: list[int] = field(default_factory=list)
    row: int = -1  # req_to_token row, -1 when not resident
    allocated_len: int = 0  # row positions [0, allocated_len) hold slots owned by this request
    kv_committed_len: int = 0  # positions whose target KV is final
    cache_node: Any = None  # mem_cache.radix_cache.TreeNode this request locked while resident, or None
    cache_len: int = 0  # row positions [0, cache_len) are prefix-cache pages (shared, read-only)
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at the first admission
    finished: FinishReason | None = None
    generator: torch.Generator | None = None
    created: float = 0.0
    first_token_time: float | None = None
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0
    detok: Any = None  # managers.detokenizer.IncrementalDetokenizer, created at the first output
    logits_processor: Any = None  # layers.logits_processor.LogitsProcessorChain, or None (nothing to apply)
    logprob: LogprobParams | None = None  # None: no logprobs asked, none computed
    input_logprobs_len: int = 0  # prompt entries delivered so far (from position logprob.start on)
    group: SampleGroup | None = None  # the other samples of the same prompt (n > 1), or None

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids
