"""The schema policy of api_fields.py, over real HTTP: every field SGLang's schema names for a feature treepage
lacks is accepted at each neutral value (with the output unchanged) and refused otherwise with a 400 naming it;
unknown fields stay refused; the literal payloads of sglang-router and bench_serving are served.

The server runs tree speculation (STANDALONE, the target as its own draft) so the SGLang state reports carry
an accept length too."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_utils import launch_server, log_tail
from treepage.entrypoints import api_fields, openai_protocol
from treepage.entrypoints.api_fields import (
    ANY,
    CHAT,
    COMPLETION,
    GENERATE,
    INERT_FIELDS,
    SAMPLING,
    SCOPES,
    STREAM_OPTIONS,
    InertField,
)

MODEL = "tiny"
NUM_STEPS = 3
DOC = Path(__file__).resolve().parents[2] / "docs" / "api_fields.md"
GREEDY = {"temperature": 0, "ignore_eos": True}
CHAT_MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(tiny_llama_dir, tmp_path_factory):
    """A client of a speculative server (one connection for the ~500 requests)."""
    log = tmp_path_factory.mktemp("api_fields") / "server.log"
    args = ["--model-path", tiny_llama_dir, "--served-model-name", MODEL, "--dtype", "float32",
            "--page-size", "4", "--max-total-tokens", "8192",
            "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", tiny_llama_dir,
            "--speculative-num-steps", str(NUM_STEPS), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(NUM_STEPS + 1)]  # fmt: skip
    with launch_server(args, log) as base, httpx.Client(base_url=base, timeout=60) as client:
        yield client
    assert "Traceback" not in log.read_text(errors="replace"), log_tail(log, 200)


# ---- one request per scope, with one extra field set -----------------------------------------------------------
def _request(scope: str, name: str | None = None, value: Any = None) -> tuple[str, dict]:
    extra = {} if name is None else {name: value}
    if scope == GENERATE:
        return "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, **GREEDY}, **extra}
    if scope == SAMPLING:
        return "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, **GREEDY, **extra}}
    if scope == COMPLETION:
        return "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, **GREEDY, **extra}
    if scope == CHAT:
        return "/v1/chat/completions", {
            "model": MODEL,
            "messages": CHAT_MSG,
            "max_tokens": 4,
            **GREEDY,
            **extra,
        }
    assert scope == STREAM_OPTIONS
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **GREEDY, "stream": True}
    return "/v1/completions", {**body, "stream_options": {"include_usage": True, **extra}}


def _text(resp: httpx.Response, scope: str) -> str:
    """The generated text, whatever the route's response shape."""
    if scope == STREAM_OPTIONS:
        events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        return "".join(c["text"] for e in events for c in e["choices"])
    body = resp.json()
    if scope in (GENERATE, SAMPLING):
        return body["text"]
    choice = body["choices"][0]
    return choice["message"]["content"] if scope == CHAT else choice["text"]


def _post(http: httpx.Client, scope: str, name: str | None = None, value: Any = None) -> httpx.Response:
    path, body = _request(scope, name, value)
    return http.post(path, json=body)


@pytest.fixture(scope="module")
def baseline(http) -> dict[str, str]:
    """Each scope's greedy output with no extra field."""
    out = {}
    for scope in SCOPES:
        r = _post(http, scope)
        assert r.status_code == 200, r.text
        out[scope] = _text(r, scope)
    assert out[GENERATE] == out[COMPLETION] != ""
    return out


# ---- the cases, derived from the table ---------------------------------------------------------------------------
# A realistic non-neutral value where a derived one would look odd; every other field gets one by _refused_value.
REFUSED_VALUES: dict[str, Any] = {
    "tool_choice": "required",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "lora_path": "my-adapter",
    "stop_regex": ["\\d"],
    "logit_bias": {"5": 10.0},
    "image_data": ["data:image/png;base64,AAAA"],
    "beam_width": 2,
    "sampling_logprobs_mode": "support",
    "suffix": " the end",
    "input_ids": [1, 2, 3],
    "reasoning_effort": "low",
    "max_thinking_tokens": 16,
    "session_id": "session-1",
    "bootstrap_port": 8998,
    "input_embeds": [[0.0, 0.1]],
}


def _refused_value(spec: InertField) -> Any:
    """A value that asks for the feature: the flipped switch, the next number, a non-empty container, else
    (for a switch whose every value is neutral, like separate_reasoning) a value of the wrong type."""
    kinds = {type(n) for n in spec.neutral} - {type(None)}
    flipped = not any(n is True for n in spec.neutral) if bool in kinds else None
    candidates = [flipped, REFUSED_VALUES.get(spec.name)]
    if kinds & {int, float}:
        candidates.append(max(n for n in spec.neutral if isinstance(n, (int, float))) + 1)
    candidates += [{"key": "value"} if dict in kinds else None, ["value"] if list in kinds else None, "value"]
    return next(v for v in candidates if v is not None and not spec.accepts(v))


def _cases() -> tuple[list, list]:
    neutral, refused = [], []
    for spec in INERT_FIELDS:
        for scope in spec.scopes:
            values = (True, "text", {"a": "b"}) if spec.neutral == ANY else spec.neutral
            for v in values:
                neutral.append(pytest.param(scope, spec.name, v, id=f"{scope}-{spec.name}={json.dumps(v)}"))
            if spec.neutral != ANY:
                v = _refused_value(spec)
                refused.append(pytest.param(scope, spec.name, v, id=f"{scope}-{spec.name}={json.dumps(v)}"))
    return neutral, refused


NEUTRAL_CASES, REFUSED_CASES = _cases()


@pytest.mark.parametrize("scope,name,value", NEUTRAL_CASES)
def test_neutral_value_is_accepted_and_changes_nothing(http, baseline, scope, name, value):
    r = _post(http, scope, name, value)
    assert r.status_code == 200, r.text
    assert _text(r, scope) == baseline[scope]


@pytest.mark.parametrize("scope,name,value", REFUSED_CASES)
def test_non_neutral_value_is_refused_naming_the_field(http, scope, name, value):
    r = _post(http, scope, name, value)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["param"] == name and err["type"] == "BadRequestError", err
    assert err["message"].startswith(f"{name}={json.dumps(value)} is not supported"), err["message"]


@pytest.mark.parametrize("scope", SCOPES)
def test_unknown_field_is_still_refused(http, scope):
    r = _post(http, scope, "no_such_field", 1)
    assert r.status_code == 400, r.text
    assert "no_such_field" in r.json()["message"] and "Extra inputs" in r.json()["message"]


def test_per_prompt_lists_of_neutral_values_are_neutral(http, baseline):
    body = {"text": ["hi", "hi"], "sampling_params": {"max_new_tokens": 4, **GREEDY},
            "return_hidden_states": [False, False], "lora_path": [None, None]}  # fmt: skip
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert [o["text"] for o in r.json()] == [baseline[GENERATE]] * 2
    body["return_hidden_states"] = [False, True]
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["param"] == "return_hidden_states", r.text


def test_json_types_are_not_confused(http):
    """false is not the neutral 0, and "1" is not the neutral 1."""
    for scope, name, value in [(SAMPLING, "frequency_penalty", False), (SAMPLING, "n", "1"),
                               (CHAT, "return_token_ids", 0), (GENERATE, "return_hidden_states", 0)]:  # fmt: skip
        r = _post(http, scope, name, value)
        assert r.status_code == 400 and r.json()["param"] == name, (name, value, r.text)


# ---- what SGLang's own tools send ------------------------------------------------------------------------------
# Captured from sglang-router 0.3.2 (forwarding plain client requests) and sglang 0.5.23's bench_serving.
ROUTER_CHAT = {"messages": CHAT_MSG, "model": MODEL, "logprobs": False, "max_completion_tokens": 3,
               "stream": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
               "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False}  # fmt: skip
ROUTER_COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": False, "echo": False,
                     "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                     "return_hidden_states": False}  # fmt: skip
ROUTER_GENERATE = {"text": "hi", "model": None, "sampling_params": {"max_new_tokens": 3},
                   "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                   "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
                   "return_entropy": False}  # fmt: skip
BENCH_GENERATE = {"text": "hi", "sampling_params": {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True},
                  "stream": False, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
                  "logprob_start_len": -1}  # fmt: skip


@pytest.mark.parametrize(
    "path,body",
    [("/v1/chat/completions", ROUTER_CHAT), ("/v1/completions", ROUTER_COMPLETION),
     ("/generate", ROUTER_GENERATE), ("/generate", BENCH_GENERATE)],
    ids=["router-chat", "router-completion", "router-generate", "bench-serving-generate"],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_sglang_tool_payloads_are_served(http, path, body, stream):
    r = http.post(path, json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text


# ---- implemented SGLang fields and state reports ---------------------------------------------------------------
def test_generate_model_and_prompt_token_ids(http, tokenizer_ids):
    body = {
        "text": "hi",
        "model": MODEL,
        "return_prompt_token_ids": True,
        "sampling_params": {"max_new_tokens": 2},
    }
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == tokenizer_ids("hi")
    plain = http.post("/generate", json={**body, "return_prompt_token_ids": False}).json()
    assert "prompt_token_ids" not in plain
    r = http.post("/generate", json={**body, "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["param"] == "model", r.text


@pytest.fixture(scope="module")
def tokenizer_ids(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    return lambda text: list(tok.encode(text))


def test_meta_info_carries_what_bench_serving_reads(http):
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 9, **GREEDY}}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert meta["completion_tokens"] == 9 and meta["prompt_tokens"] == 2
    assert meta["cached_tokens"] == 0  # no prefix cache yet
    assert meta["e2e_latency"] > 0
    assert meta["spec_accept_length"] > 1  # the draft is the target: every proposal is accepted


def test_server_info_internal_states_and_load(http):
    http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 8, **GREEDY}})
    for path in ("/server_info", "/get_server_info"):
        info = http.get(path).json()
        assert info["served_model_name"] == MODEL and info["dp_size"] == 1 and info["version"]
        assert info["max_prefill_tokens"] > 0 and info["max_total_tokens"] == 8192
        (state,) = info["internal_states"]
        # the draft is the target, so rounds emit NUM_STEPS + 1 tokens, fewer only where max_new_tokens cuts one
        assert 2 < state["avg_spec_accept_length"] <= NUM_STEPS + 1
    model_info = http.get("/model_info").json()
    assert model_info["model_type"] == "llama" and model_info["architectures"] == ["LlamaForCausalLM"]
    assert Path(model_info["tokenizer_path"]).is_dir()  # the router loads the tokenizer from it


def test_get_load_counts_requests_in_flight(http):
    idle = [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert _poll_load(http, lambda load: load == idle) == idle
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 400, **GREEDY}}
    with http.stream("POST", "/generate", json=body) as resp:
        next(resp.iter_lines())  # the request is running
        (busy,) = _poll_load(http, lambda load: load[0]["num_reqs"] == 1)
        assert busy["num_waiting_reqs"] == 0 and busy["num_tokens"] > 0
    assert _poll_load(http, lambda load: load == idle) == idle


def _poll_load(http: httpx.Client, done, timeout: float = 10.0) -> list[dict]:
    """/get_load once `done(load)` holds (the scheduler publishes its counts at the end of a step)."""
    deadline = time.monotonic() + timeout
    while not done(load := http.get("/get_load").json()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return load


# ---- penalties, logit_bias, min_new_tokens (layers/penalties.py) ---------------------------------------------
FORCED_ID, FORCED_CHAR = 50, "N"  # conftest's tokenizer: id 4 + k is chr(32 + k)
PENALTIES = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def openai_client(http):
    import openai

    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_logit_bias_through_the_openai_client_and_generate(http, openai_client):
    bias = {str(FORCED_ID): 100}
    done = openai_client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0, logit_bias=bias)
    chat = openai_client.chat.completions.create(
        model=MODEL, messages=CHAT_MSG, max_tokens=4, temperature=0, logit_bias=bias
    )
    assert done.choices[0].text == chat.choices[0].message.content == FORCED_CHAR * 4
    sp = {"max_new_tokens": 4, **GREEDY, "logit_bias": bias}
    native = http.post("/generate", json={"text": "hi", "sampling_params": sp}).json()
    assert native["output_ids"] == [FORCED_ID] * 4


def test_penalties_are_the_same_on_every_route(http, openai_client, baseline):
    done = openai_client.completions.create(
        model=MODEL, prompt="hi", max_tokens=4, temperature=0, extra_body={"ignore_eos": True, **PENALTIES}
    )
    sp = {"max_new_tokens": 4, **GREEDY, **PENALTIES}
    native = http.post("/generate", json={"text": "hi", "sampling_params": sp}).json()
    assert done.choices[0].text == native["text"] != baseline[GENERATE]  # the penalties change the output
    chat = openai_client.chat.completions.create(
        model=MODEL, messages=CHAT_MSG, max_tokens=4, temperature=0, extra_body={"ignore_eos": True, **PENALTIES}
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 4


def test_seeded_sampling_with_penalties_is_reproducible_over_http(openai_client):
    def sample(seed: int) -> str:
        extra = {"ignore_eos": True, "top_k": 20, **PENALTIES, "logit_bias": {str(FORCED_ID): 3}}
        out = openai_client.completions.create(
            model=MODEL, prompt="hi", max_tokens=24, temperature=1.0, seed=seed, extra_body=extra
        )
        return out.choices[0].text

    assert sample(7) == sample(7) != sample(8)


def test_min_tokens_holds_back_a_stop_token(http, openai_client):
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    first = http.post("/generate", json=body).json()["output_ids"][0]
    body["sampling_params"]["stop_token_ids"] = [first]
    assert http.post("/generate", json=body).json()["output_ids"] == [first]  # stops at once
    body["sampling_params"]["min_new_tokens"] = 3
    held = http.post("/generate", json=body).json()
    assert len(held["output_ids"]) >= 3 and first not in held["output_ids"][:3]
    done = openai_client.completions.create(
        model=MODEL, prompt="hi", max_tokens=8, temperature=0, extra_body={"stop_token_ids": [first], "min_tokens": 3}
    )
    assert done.usage.completion_tokens == len(held["output_ids"])


INVALID = [("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0), ("logit_bias", {"x": 1}),
           ("logit_bias", {"5": 101}), ("logit_bias", {"100000": 1}), ("frequency_penalty", "1"),
           ("logit_bias", {"5": "high"})]  # fmt: skip


@pytest.mark.parametrize("scope", [SAMPLING, COMPLETION, CHAT])
@pytest.mark.parametrize("name,value", INVALID + [("min_new_tokens", -1), ("min_new_tokens", 5)])
def test_invalid_penalty_is_a_400_naming_it(http, scope, name, value):
    if name == "min_new_tokens" and scope != SAMPLING:
        name = "min_tokens"  # the OpenAI routes' name
    r = _post(http, scope, name, value)  # max tokens 4
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["param"] == name and name in err["message"] and err["type"] == "BadRequestError", err
    assert _post(http, scope).status_code == 200  # the server keeps serving


def test_openai_client_sees_a_typed_error_for_a_bad_penalty(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError, match="frequency_penalty") as exc:
        openai_client.chat.completions.create(model=MODEL, messages=CHAT_MSG, max_tokens=2, frequency_penalty=-2.5)
    assert exc.value.body["param"] == "frequency_penalty"


# ---- the table itself (no server) ------------------------------------------------------------------------------
def test_table_has_one_row_per_field_and_scope():
    seen = set()
    for spec in INERT_FIELDS:
        assert spec.scopes and set(spec.scopes) <= set(SCOPES), spec
        assert spec.neutral == ANY or (spec.neutral and spec.feature), spec
        for scope in spec.scopes:
            assert (scope, spec.name) not in seen, (scope, spec.name)
            seen.add((scope, spec.name))


BODIES = {
    GENERATE: openai_protocol.GenerateRequest,
    SAMPLING: openai_protocol.NativeSamplingParams,
    COMPLETION: openai_protocol.CompletionRequest,
    CHAT: openai_protocol.ChatCompletionRequest,
    STREAM_OPTIONS: openai_protocol.StreamOptions,
}


@pytest.mark.parametrize("scope", SCOPES)
def test_no_inert_field_shadows_an_implemented_one(scope):
    model = BODIES[scope]
    assert model.inert_scope == scope
    implemented = set()
    for cls in model.__mro__:
        if getattr(cls, "__pydantic_fields__", None) is not None and not cls.__name__.startswith("_Inert_"):
            implemented |= set(getattr(cls, "__annotations__", {})) - {"inert_scope", "model_config"}
    inert = set(api_fields.inert_fields(scope))
    assert not implemented & inert
    assert inert <= set(model.model_fields)


def _doc_row(spec: InertField) -> str:
    scopes = ", ".join(spec.scopes)
    feature = spec.feature or "no effect on the output"
    return f"| `{spec.name}` | {scopes} | {spec.neutral_text()} | {feature} |"


def test_docs_list_the_table():
    doc = DOC.read_text()
    rows = [line for line in doc.splitlines() if re.match(r"\| `\w+` \|", line)]
    expected = [_doc_row(s) for s in INERT_FIELDS]
    assert rows == expected, "docs/api_fields.md is out of date; its table rows should be:\n" + "\n".join(
        expected
    )
