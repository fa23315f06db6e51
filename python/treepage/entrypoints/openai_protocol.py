"""Request bodies of the OpenAI and native routes, and their mapping onto engine sampling params.

Bodies are parsed strictly (no "5" -> 5 coercion, unknown fields refused) so a client typo surfaces as a 400
naming the field instead of being silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

MAX_ERRORS_SHOWN = 5


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem, 'field: why', capped so a deeply wrong body stays readable."""
    errors = exc.errors(include_url=False)
    if errors and errors[0]["type"] == "json_invalid":
        return f"the request body is not valid JSON: {errors[0]['msg']}"
    parts = []
    for e in errors[:MAX_ERRORS_SHOWN]:
        loc = ".".join(str(x) for x in e["loc"]) or "body"
        parts.append(f"{loc}: {e['msg']}")
    more = len(errors) - MAX_ERRORS_SHOWN
    return "; ".join(parts) + (f"; ... and {more} more" if more > 0 else "")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # accepted for compatibility, not used


class _OpenAISampling(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names + SGLang extras)."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    n: StrictInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: StrictInt | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    rid: str | None = None

    def unsupported(self) -> str | None:
        """Message for the first requested feature treepage does not implement, else None."""
        if self.n not in (None, 1):
            return f"n={self.n} is not supported; only n=1"
        if self.frequency_penalty or self.presence_penalty:
            return "frequency_penalty and presence_penalty are not supported; use 0"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        sp: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": self.ignore_eos}
        sp["skip_special_tokens"] = self.skip_special_tokens
        for key in ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids"):
            value = getattr(self, key)
            if value is not None:
                sp[key] = value
        return sp

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: bool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> str | None:
        if self.logprobs is not None:
            return "logprobs are not supported"
        if self.echo:
            return "echo=true is not supported"
        if self.suffix:
            return "suffix is not supported"
        if self.best_of not in (None, 1):
            return "best_of > 1 is not supported"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a batch: text items or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # one pre-tokenized prompt
        return list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.logprobs or self.top_logprobs is not None:
            return "logprobs are not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return f"response_format type {self.response_format.get('type')!r} is not supported; only 'text'"
        return super().unsupported()

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class NativeSamplingParams(BaseModel):
    """The native /generate sampling_params. Unknown keys pass through; the engine names and refuses them."""

    model_config = ConfigDict(extra="allow", strict=True)

    max_new_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    seed: StrictInt | None = None
    sampling_seed: StrictInt | None = None  # SGLang's name for seed

    def to_dict(self) -> dict[str, Any]:
        """None means 'use the default', as in SGLang."""
        d = {k: v for k, v in self.model_dump().items() if v is not None}
        seed = d.pop("sampling_seed", None)
        if seed is not None:
            d.setdefault("seed", seed)
        return d


class GenerateRequest(_Body):
    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    stream: bool = False
    rid: str | list[str] | None = None

    def batch(self) -> tuple[bool, list[str | list[int]]]:
        """(is_single, prompts). Raises ValueError unless exactly one of text / input_ids is given."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' or 'input_ids'")
        if self.text is not None:
            return (True, [self.text]) if isinstance(self.text, str) else (False, list(self.text))
        ids = self.input_ids
        if ids and all(isinstance(x, int) for x in ids):
            return True, [list(ids)]
        if not ids:
            raise ValueError("input_ids is empty")
        return False, [list(x) for x in ids]

    def per_item(self, n: int) -> tuple[list[dict[str, Any]], list[str | None]]:
        """Sampling params and rids, one per prompt (a single value applies to every prompt)."""
        sp = self.sampling_params
        if isinstance(sp, list):
            if len(sp) != n:
                raise ValueError(f"sampling_params has {len(sp)} entries for {n} prompts")
            params = [p.to_dict() for p in sp]
        else:
            params = [sp.to_dict() if sp else {} for _ in range(n)]
        rid = self.rid
        if isinstance(rid, list):
            if len(rid) != n:
                raise ValueError(f"rid has {len(rid)} entries for {n} prompts")
            rids: list[str | None] = list(rid)
        else:
            rids = [rid] if n == 1 else [f"{rid}-{i}" if rid else None for i in range(n)]
        return params, rids


def openai_finish_reason(meta: dict) -> tuple[str | None, int | str | None]:
    """(finish_reason, matched_stop) in OpenAI terms from an engine finish-reason dict."""
    fr = meta.get("finish_reason")
    if not fr:
        return None, None
    return fr["type"], fr.get("matched")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},  # prompt tokens served by the prefix cache
    }
