"""Structured output over real HTTP from a tree-speculative server: OpenAI's response_format (json_schema,
json_object) on chat and completions through the official client, streamed and not; /generate with json_schema,
regex, ebnf and choice; invalid constraints and two constraints at once refused with a 400 naming the field while
the server keeps serving and leaks nothing."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from server_utils import checked_server, tiny_spec_server_args

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9,
          "minimum": 0}}, "required": ["ok", "n"]}  # fmt: skip
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def base(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("http_grammar") / "server.log"
    with checked_server(tiny_spec_server_args(tiny_llama_dir, MODEL), log) as url:
        yield url


@pytest.fixture(scope="module")
def http(base):
    with httpx.Client(base_url=base, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def _check(text: str) -> bool:
    value = json.loads(text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9, value
    return True


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format_json_schema(client, stream):
    kw = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 40, "response_format": FORMAT}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["stop"]
    else:
        out = client.chat.completions.create(**kw)
        text = out.choices[0].message.content or ""
        assert out.choices[0].finish_reason == "stop"
    _check(text)


def test_chat_json_object_and_text(client):
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=60, response_format={"type": "json_object"}
    )
    text = out.choices[0].message.content or ""
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=8)
    same = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=8, response_format={"type": "text"}
    )
    assert plain.choices[0].message.content == same.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_completions_response_format_and_regex(client, stream):
    kw = {"model": MODEL, "prompt": "Answer:", "temperature": 0, "max_tokens": 40}
    if stream:
        chunks = list(client.completions.create(stream=True, extra_body={"response_format": FORMAT}, **kw))
        _check("".join(c.choices[0].text for c in chunks if c.choices))
    else:
        _check(client.completions.create(extra_body={"response_format": FORMAT}, **kw).choices[0].text)
    out = client.completions.create(extra_body={"regex": r"[a-c]{2}-[0-9]{3}"}, **kw)
    assert re.fullmatch(r"[a-c]{2}-[0-9]{3}", out.choices[0].text)


def test_generate_json_schema_regex_ebnf_choice(http):
    cases = [("json_schema", json.dumps(SCHEMA), _check),
             ("regex", r"(red|green|blue) [0-9]{2}", lambda t: re.fullmatch(r"(red|green|blue) [0-9]{2}", t)),
             ("ebnf", 'root ::= "<" [a-z] [a-z]? ">"', lambda t: re.fullmatch(r"<[a-z]{1,2}>", t)),
             ("choice", ["left", "right"], lambda t: t in ("left", "right"))]  # fmt: skip
    body = {"text": ["Hi", "Hello there"], "sampling_params": [
        {"temperature": 0, "max_new_tokens": 40, field: value} for field, value, _ in cases[:2]]}  # fmt: skip
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    for (_, _, check), out in zip(cases, r.json()):
        assert check(out["text"]), out["text"]
    for field, value, check in cases[2:]:
        r = http.post("/generate", json={"text": "Hi", "sampling_params": {"temperature": 0, field: value}})
        assert r.status_code == 200 and check(r.json()["text"]), r.text


@pytest.mark.parametrize(
    "path,body,field",
    [("/generate", {"text": "Hi", "sampling_params": {"regex": "a("}}, "regex"),
     ("/generate", {"text": "Hi", "sampling_params": {"json_schema": "{nope"}}, "json_schema"),
     ("/generate", {"text": "Hi", "sampling_params": {"ebnf": "root ::= "}}, "ebnf"),
     ("/generate", {"text": "Hi", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "regex"),
     ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"choice": ["x", ""]}]}, "choice"),
     ("/v1/completions", {"model": MODEL, "prompt": "Hi", "json_schema": '{"type": 5}'}, "json_schema"),
     ("/v1/completions", {"model": MODEL, "prompt": "Hi", "regex": "a", "response_format": FORMAT},
      "response_format"),
     ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "response_format": {"type": "xml"}},
      "response_format"),
     ("/v1/chat/completions", {"model": MODEL, "messages": CHAT,
                               "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
      "response_format"),
     ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "ebnf": "x ::= y"}, "ebnf")],
)  # fmt: skip
def test_invalid_constraints_are_400_naming_the_field(http, path, body, field):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["param"] == field and field in err["message"], err
    ok = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200  # the server keeps serving
