"""The request fields of SGLang's API that drive features treepage does not have, and their neutral values.

SGLang's gateway (sglang-router) and its benchmark client send SGLang's whole request schema, defaults
included (`lora_path: null`, `return_hidden_states: false`, `separate_reasoning: true`, ...). treepage accepts
such a field at a neutral value, one that leaves the result unchanged, and refuses any other value with a 400
that names the field. So an SGLang client works unchanged until it asks for something treepage cannot do,
and then learns exactly what. Fields in neither this table nor the request models are unknown and refused.

The table is the single source: the request models in openai_protocol.py declare these fields from it, and
docs/api_fields.md lists it for users. Field names and scopes follow SGLang 0.5.23 (GenerateReqInput,
SamplingParams, and the OpenAI-compatible CompletionRequest / ChatCompletionRequest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Where a field appears.
GENERATE = "generate"  # top level of the native POST /generate body
SAMPLING = "sampling"  # native /generate sampling_params
COMPLETION = "completion"  # POST /v1/completions
CHAT = "chat"  # POST /v1/chat/completions
STREAM_OPTIONS = "stream_options"  # the OpenAI bodies' stream_options object
SCOPES = (GENERATE, SAMPLING, COMPLETION, CHAT, STREAM_OPTIONS)
OPENAI = (COMPLETION, CHAT)

ANY = "<any value>"  # a hint that never changes the output (logging, routing among replicas)


class UnsupportedField(ValueError):
    """A field set to a value that asks for a feature treepage does not have; rendered as a 400."""

    def __init__(self, name: str, value: Any, spec: InertField) -> None:
        self.field = name
        shown = json.dumps(value) if _jsonable(value) else repr(value)
        super().__init__(
            f"{name}={shown} is not supported: treepage does not support {spec.feature}; "
            f"leave {name} out or send {spec.neutral_text()}"
        )


@dataclass(frozen=True)
class InertField:
    """A field treepage accepts only at a neutral value, because the feature it drives is missing."""

    name: str
    neutral: tuple[Any, ...] | str  # the accepted values, or ANY
    feature: str  # what treepage lacks, named in the 400
    scopes: tuple[str, ...]

    def accepts(self, value: Any) -> bool:
        if self.neutral == ANY:
            return True
        if any(_same(value, n) for n in self.neutral):
            return True
        # a per-prompt list (SGLang allows one value per prompt of a batch) is neutral when every entry is
        return isinstance(value, list) and all(self.accepts(v) for v in value)

    def check(self, value: Any) -> None:
        if not self.accepts(value):
            raise UnsupportedField(self.name, value, self)

    def neutral_text(self) -> str:
        if self.neutral == ANY:
            return "any value"
        return " or ".join(json.dumps(n) for n in self.neutral)


def _same(value: Any, neutral: Any) -> bool:
    """JSON-typed equality: 0 matches 0.0, but false never matches 0 and "1" never matches 1."""
    if neutral is None or isinstance(neutral, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == neutral
    return type(value) is type(neutral) and value == neutral


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _f(name: str, neutral: tuple[Any, ...] | str, feature: str, *scopes: str | tuple[str, ...]) -> InertField:
    flat: list[str] = []
    for s in scopes:
        flat.extend(s if isinstance(s, tuple) else (s,))
    return InertField(name, neutral, feature, tuple(flat))


NULL: tuple[Any, ...] = (None,)
OFF: tuple[Any, ...] = (None, False)
EMPTY_LIST: tuple[Any, ...] = (None, [])
EMPTY_DICT: tuple[Any, ...] = (None, {})

LOGPROBS = "flat or raw logprob layouts and logprob modes"
MULTIMODAL = "multimodal input (this is a text-only engine)"
PD = "prefill/decode disaggregation"

# fmt: off
INERT_FIELDS: tuple[InertField, ...] = (
    # ---- logprobs: flat/raw variants, modes and extra outputs (per-token logprobs are implemented) ---------
    _f("return_flat_raw_top_logprobs", OFF, LOGPROBS, GENERATE),
    _f("return_flat_raw_output_top_logprobs", OFF, LOGPROBS, GENERATE, CHAT),
    _f("return_flat_raw_top_logprobs_b64", (None, True, False), LOGPROBS, CHAT),  # only shapes absent logprobs
    _f("sampling_logprobs_mode", NULL, LOGPROBS, GENERATE, CHAT),
    _f("return_sampling_mask", OFF, "sampling-mask output", GENERATE, CHAT),
    _f("suffix", (None, ""), "suffix insertion", COMPLETION),
    _f("return_entropy", OFF, "entropy output", GENERATE),
    # ---- other sampling methods (n, parallel samples, is implemented) ---------------------------------------
    _f("best_of", (None, 1), "best_of (ranking samples on the server; n returns every sample)", COMPLETION),
    _f("min_p", (None, 0), "min-p sampling", SAMPLING, OPENAI),
    _f("beam_width", NULL, "beam search", SAMPLING),
    # ---- tools ---------------------------------------------------------------------------------------------------
    _f("tools", EMPTY_LIST, "tool calling", CHAT),
    _f("tool_choice", (None, "none", "auto"), "tool calling", CHAT),  # "auto" with no tools calls none
    _f("parallel_tool_calls", (None, True, False), "tool calling", CHAT),  # no effect without tools
    # ---- stopping and detokenization --------------------------------------------------------------------------
    _f("stop_regex", EMPTY_LIST, "stop regexes", SAMPLING, OPENAI),
    _f("no_stop_trim", OFF, "untrimmed stop strings", SAMPLING, OPENAI),
    _f("spaces_between_special_tokens", (None, True), "a detokenizer option for special tokens", SAMPLING),
    _f("stream_interval", (None, 1), "a per-request stream interval (every step is streamed)", SAMPLING),
    _f("continuous_usage_stats", OFF, "usage in every stream chunk", STREAM_OPTIONS),
    # ---- chat templating and reasoning (no reasoning parser) --------------------------------------------------
    _f("continue_final_message", OFF, "continuation of the final assistant message", CHAT),
    _f("chat_template_kwargs", EMPTY_DICT, "chat template arguments", CHAT),
    _f("input_ids", NULL, "pre-tokenized chat prompts", CHAT),
    _f("separate_reasoning", (None, True, False), "reasoning parser", CHAT),  # no effect without a parser
    _f("stream_reasoning", (None, True, False), "reasoning parser", CHAT),
    _f("reasoning_effort", NULL, "reasoning controls", CHAT),
    _f("thinking", NULL, "reasoning controls", CHAT),
    _f("task", NULL, "DeepSeek task prompts", CHAT),
    _f("require_reasoning", OFF, "reasoning controls", GENERATE),
    _f("max_thinking_tokens", NULL, "reasoning controls", GENERATE),
    # ---- extra outputs ----------------------------------------------------------------------------------------
    _f("return_hidden_states", OFF, "hidden-state output", GENERATE, OPENAI),
    _f("return_routed_experts", OFF, "MoE routing output", GENERATE, OPENAI),
    _f("routed_experts_start_len", (None, 0), "MoE routing output", GENERATE, OPENAI),
    _f("return_indexer_topk", OFF, "indexer output", GENERATE),
    _f("return_cached_tokens_details", OFF, "cached-token details", OPENAI),
    _f("return_spec_tokens_details", OFF, "per-request speculation details in OpenAI responses", OPENAI),
    _f("return_token_ids", OFF, "token ids in OpenAI responses", OPENAI),
    _f("return_prompt_token_ids", OFF, "prompt token ids in chat responses", CHAT),
    _f("return_meta_info", OFF, "meta_info in chat responses", CHAT),
    _f("return_input_ids_in_sglext", OFF, "token ids in chat responses", CHAT),
    _f("return_output_ids_in_sglext", OFF, "token ids in chat responses", CHAT),
    _f("return_bytes", OFF, "byte output", GENERATE),
    # ---- LoRA, custom processors, watermarks ------------------------------------------------------------------
    _f("lora_path", NULL, "LoRA adapters", GENERATE, OPENAI),
    _f("lora_id", NULL, "LoRA adapters", GENERATE),
    _f("custom_logit_processor", NULL, "custom logit processors", GENERATE, OPENAI),
    _f("custom_params", EMPTY_DICT, "custom logit processors", SAMPLING, OPENAI),
    _f("watermark", NULL, "watermarking", GENERATE, SAMPLING, OPENAI),
    # ---- multimodal, embeddings, scoring ----------------------------------------------------------------------
    _f("input_embeds", NULL, "embedding input", GENERATE),
    _f("image_data", EMPTY_LIST, MULTIMODAL, GENERATE),
    _f("video_data", EMPTY_LIST, MULTIMODAL, GENERATE),
    _f("audio_data", EMPTY_LIST, MULTIMODAL, GENERATE),
    _f("mm_hashes", EMPTY_LIST, MULTIMODAL, GENERATE),
    _f("mm_content_hashes", EMPTY_LIST, MULTIMODAL, GENERATE),
    _f("modalities", EMPTY_LIST, MULTIMODAL, GENERATE),
    _f("use_audio_in_video", OFF, MULTIMODAL, GENERATE, CHAT),
    _f("video_config", EMPTY_DICT, MULTIMODAL, GENERATE, CHAT),
    _f("images_config", EMPTY_DICT, MULTIMODAL, GENERATE, OPENAI),
    _f("mm_processor_kwargs", EMPTY_DICT, MULTIMODAL, GENERATE, OPENAI),
    _f("max_dynamic_patch", NULL, MULTIMODAL, GENERATE, CHAT),
    _f("min_dynamic_patch", NULL, MULTIMODAL, GENERATE, CHAT),
    _f("image_max_dynamic_patch", NULL, MULTIMODAL, GENERATE),
    _f("video_max_dynamic_patch", NULL, MULTIMODAL, GENERATE),
    _f("need_wait_for_mm_inputs", OFF, MULTIMODAL, GENERATE),
    _f("num_items_assigned", NULL, MULTIMODAL, GENERATE),
    _f("encoder_urls", EMPTY_LIST, MULTIMODAL, GENERATE),
    _f("positional_embed_overrides", NULL, "positional-embedding overrides", GENERATE),
    _f("multi_item_delimiter_indices", NULL, "multi-item scoring", GENERATE),
    _f("token_indices_to_pool", NULL, "pooling (embedding models)", GENERATE),
    # ---- sessions and cache namespaces ------------------------------------------------------------------------
    _f("session_id", NULL, "sessions", GENERATE, OPENAI),
    _f("session_params", EMPTY_DICT, "sessions", GENERATE, OPENAI),
    _f("extra_key", NULL, "prefix-cache namespaces", GENERATE, OPENAI),
    _f("cache_salt", NULL, "prefix-cache namespaces", GENERATE, OPENAI),
    _f("kv_hints", NULL, "KV-cache hints", GENERATE),
    # ---- scheduling, parallelism, disaggregation --------------------------------------------------------------
    _f("priority", (None, 0), "priority scheduling", GENERATE, OPENAI),
    _f("background", OFF, "background requests", GENERATE),
    _f("routed_dp_rank", (None, 0), "data parallelism (rank 0 is the only one)", GENERATE, OPENAI),
    _f("data_parallel_rank", (None, 0), "data parallelism (rank 0 is the only one)", GENERATE, OPENAI),
    _f("disagg_prefill_dp_rank", NULL, PD, GENERATE, OPENAI),
    _f("bootstrap_host", NULL, PD, GENERATE, OPENAI),
    _f("bootstrap_port", NULL, PD, GENERATE, OPENAI),
    _f("bootstrap_room", NULL, PD, GENERATE, OPENAI),
    _f("bootstrap_pair_key", NULL, PD, GENERATE),
    _f("decode_tp_size", NULL, PD, GENERATE),
    _f("http_worker_ipc", NULL, "multi-tokenizer workers", GENERATE),
    _f("received_time", NULL, "multi-tokenizer workers", GENERATE),
    # ---- observability and routing hints: never change the output ---------------------------------------------
    _f("log_metrics", ANY, "", GENERATE),
    _f("no_logs", ANY, "", GENERATE),
    _f("custom_labels", ANY, "", GENERATE, OPENAI),
    _f("external_trace_header", ANY, "", GENERATE),
    _f("routing_key", ANY, "", GENERATE),
    _f("conversation_id", ANY, "", GENERATE),
)
# fmt: on


_BY_SCOPE = {scope: {f.name: f for f in INERT_FIELDS if scope in f.scopes} for scope in SCOPES}


def inert_fields(scope: str) -> dict[str, InertField]:
    """The scope's inert fields by name."""
    return _BY_SCOPE[scope]


def check_inert(scope: str, values: dict[str, Any]) -> None:
    """Raise UnsupportedField for the first inert field of `values` that is set to a non-neutral value."""
    specs = _BY_SCOPE[scope]
    for name, value in values.items():
        spec = specs.get(name)
        if spec is not None:
            spec.check(value)
