"""Request bodies of the OpenAI and native routes, and their mapping onto engine sampling params.

Bodies are parsed strictly (no "5" -> 5 coercion, unknown fields refused) so a client typo surfaces as a 400
naming the field instead of being silently ignored. Each body also declares the fields of SGLang's schema that
drive features treepage lacks (api_fields.py); check_inert() accepts those only at their neutral values.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError, create_model

from treepage.core import LogprobParams, SamplingParamError, check_num_samples
from treepage.entrypoints import api_fields
from treepage.entrypoints.api_fields import CHAT, COMPLETION, GENERATE, SAMPLING, STREAM_OPTIONS

MAX_ERRORS_SHOWN = 5
MAX_OPENAI_TOP_LOGPROBS = 20  # OpenAI's chat limit, used for the completions' integer logprobs too


class InvalidField(SamplingParamError):
    """A request field whose value is well-typed but out of range; the 400 names it (message "field: why")."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(name, f"{name}: {message}")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    inert_scope: ClassVar[str | None] = None  # which rows of api_fields.INERT_FIELDS this body declares

    def check_inert(self) -> None:
        """Raise api_fields.UnsupportedField if an inert field, here or in a nested body, is not neutral."""
        sent = {name: getattr(self, name) for name in self.model_fields_set}
        if self.inert_scope is not None:
            api_fields.check_inert(self.inert_scope, sent)
        for value in sent.values():
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, _Body):
                    item.check_inert()


def _with_inert_fields(scope: str) -> type[_Body]:
    """A base declaring the scope's inert fields: any JSON value parses; check_inert() then judges it."""
    fields: dict[str, Any] = {name: (Any, None) for name in api_fields.inert_fields(scope)}
    base = create_model(f"_Inert_{scope}", __base__=_Body, **fields)
    base.inert_scope = scope
    return base


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


def validation_error_param(exc: ValidationError) -> str | None:
    """The request field the first problem is about (the innermost one on its path), for the 400's "param"."""
    errors = exc.errors(include_url=False)
    names = _request_field_names()
    return next((x for x in reversed(errors[0]["loc"]) if isinstance(x, str) and x in names), None) if errors else None


def _request_field_names() -> set[str]:
    bodies = (GenerateRequest, NativeSamplingParams, CompletionRequest, ChatCompletionRequest, ChatMessage)
    return {name for body in (*bodies, StreamOptions, TextPart) for name in body.model_fields}


if TYPE_CHECKING:  # the type checker sees the plain base; at run time each base declares its scope's inert fields
    _InertStreamOptions = _Body
    _InertCompletion = _Body
    _InertChat = _Body
    _InertSampling = _Body
    _InertGenerate = _Body
else:
    _InertStreamOptions = _with_inert_fields(STREAM_OPTIONS)
    _InertCompletion = _with_inert_fields(COMPLETION)
    _InertChat = _with_inert_fields(CHAT)
    _InertSampling = _with_inert_fields(SAMPLING)
    _InertGenerate = _with_inert_fields(GENERATE)


class StreamOptions(_InertStreamOptions):
    include_usage: bool = False


_PENALTY_KEYS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")
_GRAMMAR_KEYS = ("json_schema", "regex", "ebnf")
ANY_JSON_OBJECT = '{"type": "object"}'


def response_format_schema(fmt: dict[str, Any] | None) -> str | None:
    """OpenAI's response_format -> the JSON schema (a string) output must follow; None for plain text.

    {"type": "text"}; {"type": "json_object"} (any JSON object); {"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}} (a missing schema means any JSON object)."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return ANY_JSON_OBJECT
    if kind == "json_schema" and set(fmt) <= {"type", "json_schema"}:
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not set(spec) <= {"name", "schema", "strict", "description"}:
            raise InvalidField(
                "response_format",
                'json_schema must be an object with "name", "schema", "strict", "description"',
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, (dict, bool)):
            raise InvalidField("response_format", "json_schema.schema must be a JSON schema object")
        return json.dumps(schema)
    raise InvalidField(
        "response_format",
        f'must be {{"type": "text"}}, {{"type": "json_object"}} or '
        f'{{"type": "json_schema", "json_schema": {{...}}}}, got {json.dumps(fmt)[:200]}',
    )


class _OpenAISampling(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names + SGLang extras)."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: StrictInt | None = None
    user: str | None = None  # OpenAI's end-user id: informational only
    rid: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    min_tokens: StrictInt | None = None  # SGLang's min_new_tokens
    # structured output (layers/grammar.py): SGLang's regex / ebnf, OpenAI's response_format
    regex: str | None = None
    ebnf: str | None = None
    response_format: dict[str, Any] | None = None
    n: StrictInt | None = None  # parallel samples per prompt (docs/design.md, "Parallel sampling")

    def num_samples(self) -> int:
        n = 1 if self.n is None else self.n
        check_num_samples(n)
        return n

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        sp: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": self.ignore_eos}
        sp["skip_special_tokens"] = self.skip_special_tokens
        for key in ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", *_PENALTY_KEYS, *_GRAMMAR_KEYS):
            value = getattr(self, key, None)  # json_schema is a completions field only
            if value is not None:
                sp[key] = value
        if self.min_tokens is not None:
            if not 0 <= self.min_tokens <= max_new_tokens:  # checked here so the 400 names this route's field
                raise SamplingParamError(
                    "min_tokens", f"min_tokens must be in [0, {max_new_tokens}] (max tokens), got {self.min_tokens}"
                )
            sp["min_new_tokens"] = self.min_tokens
        schema = response_format_schema(self.response_format)
        if schema is not None:
            others = [k for k in _GRAMMAR_KEYS if sp.get(k) is not None]
            if others:
                raise SamplingParamError(
                    "response_format",
                    f"only one of response_format, {', '.join(others)} may be set per request",
                )
            sp["json_schema"] = schema
        return sp

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAISampling, _InertCompletion):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    json_schema: str | None = None  # SGLang's completion field (chat has response_format)
    logprobs: StrictInt | None = None  # top-n per token (0: the chosen tokens' logprobs only)
    echo: bool = False  # the prompt is prepended to the text (and its logprobs to the logprobs)

    def logprob_params(self) -> LogprobParams | None:
        n = self.logprobs
        if n is None:
            return None  # echo alone prepends the prompt's text: no logits needed
        if not 0 <= n <= MAX_OPENAI_TOP_LOGPROBS:
            raise InvalidField("logprobs", f"must be in [0, {MAX_OPENAI_TOP_LOGPROBS}], got {n}")
        return LogprobParams(start=0 if self.echo else -1, top_n=n)

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a batch: text items or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [cast(list[int], list(p))]  # one pre-tokenized prompt
        return cast(list[str | list[int]], list(p))


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


class ChatCompletionRequest(_OpenAISampling, _InertChat):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None

    def logprob_params(self) -> LogprobParams | None:
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_OPENAI_TOP_LOGPROBS:
            raise InvalidField("top_logprobs", f"must be in [0, {MAX_OPENAI_TOP_LOGPROBS}], got {top}")
        if top and not self.logprobs:
            raise InvalidField("top_logprobs", "needs logprobs set to true")
        return LogprobParams(top_n=top or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class NativeSamplingParams(_InertSampling):
    """The native /generate sampling_params."""

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
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_new_tokens: StrictInt | None = None
    json_schema: str | None = None  # structured output (layers/grammar.py): at most one of these
    regex: str | None = None
    ebnf: str | None = None
    choice: list[str] | None = None
    structural_tag: str | None = None
    n: StrictInt | None = None  # parallel samples of the prompt (GenerateRequest.num_samples)

    def to_dict(self) -> dict[str, Any]:
        """The engine's sampling params; None means 'use the default', as in SGLang. Inert fields are neutral
        once check_inert() has passed, so they are left out; so is n, a property of the request."""
        implemented = self.model_dump(exclude={"n", *api_fields.inert_fields(SAMPLING)})
        d = {k: v for k, v in implemented.items() if v is not None}
        seed = d.pop("sampling_seed", None)
        if seed is not None:
            d.setdefault("seed", seed)
        return d


class GenerateRequest(_InertGenerate):
    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    model: str | None = None  # sglang-router sends it; checked like the OpenAI routes' model
    return_prompt_token_ids: bool = False
    # logprobs: one value for every prompt, or a list with one per prompt (SGLang's forms)
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: StrictInt | list[StrictInt] | None = None
    top_logprobs_num: StrictInt | list[StrictInt] | None = None
    token_ids_logprob: list[StrictInt] | list[list[StrictInt]] | None = None
    return_text_in_logprobs: bool | None = None

    def logprob_params(self, n: int) -> list[LogprobParams | None]:
        """One per prompt; None where return_logprob is not set."""
        ret = _per_prompt("return_logprob", self.return_logprob, n)
        start = _per_prompt("logprob_start_len", self.logprob_start_len, n)
        top = _per_prompt("top_logprobs_num", self.top_logprobs_num, n)
        ids = self.token_ids_logprob
        if ids and all(isinstance(x, list) for x in ids):
            if len(ids) != n:
                raise InvalidField("token_ids_logprob", f"has {len(ids)} lists for {n} prompts")
            per_ids = [tuple(cast(list[int], x)) for x in ids]
        else:
            per_ids = [tuple(cast(list[int], ids or []))] * n
        out: list[LogprobParams | None] = []
        for r, s, t, i in zip(ret, start, top, per_ids):
            if s is not None and s < -1:
                raise InvalidField("logprob_start_len", f"must be -1 or a prompt position, got {s}")
            if t is not None and t < 0:
                raise InvalidField("top_logprobs_num", f"must be >= 0, got {t}")
            out.append(LogprobParams(-1 if s is None else s, t or 0, i) if r else None)
        return out

    def batch(self) -> tuple[bool, list[str | list[int]]]:
        """(is_single, prompts). Raises ValueError unless exactly one of text / input_ids is given."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' or 'input_ids'")
        if self.text is not None:
            return (True, [self.text]) if isinstance(self.text, str) else (False, list(self.text))
        ids = self.input_ids
        if ids and all(isinstance(x, int) for x in ids):
            return True, [cast(list[int], list(ids))]
        if not ids:
            raise ValueError("input_ids is empty")
        return False, [list(cast(list[int], x)) for x in ids]

    def num_samples(self) -> int:
        """n of sampling_params: one value for every prompt (as SGLang requires)."""
        sp = self.sampling_params
        values = {1 if p.n is None else p.n for p in (sp if isinstance(sp, list) else [sp] if sp else [])}
        if len(values) > 1:
            raise InvalidField("n", f"must be the same for every prompt, got {sorted(values)}")
        n = values.pop() if values else 1
        check_num_samples(n)
        return n

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


def _per_prompt(name: str, value: Any, n: int) -> list[Any]:
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise InvalidField(name, f"has {len(value)} entries for {n} prompts")
    return value


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
