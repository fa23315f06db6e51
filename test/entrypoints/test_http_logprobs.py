"""Logprobs over real HTTP from a tree-speculative server (so output entries come from verify rows): SGLang's
native meta_info lists (single, batched with per-prompt values, streamed), OpenAI completions `logprobs` / `echo`
and chat `logprobs` / `top_logprobs` parsed by the official client, streamed and not, and invalid values refused
with a 400 naming the field while the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_utils import checked_server, tiny_spec_server_args

MODEL = "tiny"
GREEDY = {"temperature": 0, "ignore_eos": True}
GREEDY_OAI = {"temperature": 0, "extra_body": {"ignore_eos": True}}
CHAT = [{"role": "user", "content": "Say something."}]
TOL = 1e-4


@pytest.fixture(scope="module")
def base(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("http_logprobs") / "server.log"
    with checked_server(tiny_spec_server_args(tiny_llama_dir, MODEL), log) as url:
        yield url


@pytest.fixture(scope="module")
def http(base):
    with httpx.Client(base_url=base, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def sse(resp: httpx.Response) -> list[dict]:
    return [json.loads(x[6:]) for x in resp.text.splitlines() if x.startswith("data: {")]


def test_native_generate_shapes(http, tokenizer):
    ids = tokenizer.encode("The cat sat on")
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, **GREEDY}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 3, "token_ids_logprob": [5, 6],
            "return_text_in_logprobs": True}  # fmt: skip
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == ids
    assert meta["input_token_logprobs"][0][0] is None
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    for e in meta["input_token_logprobs"] + meta["output_token_logprobs"]:
        assert e[2] == tokenizer.decode([e[1]])
    for top in meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]:
        assert len(top) == 3 and top[0][0] >= top[1][0] >= top[2][0]
    for pair in meta["output_token_ids_logprobs"]:
        assert [x[1] for x in pair] == [5, 6] and all(x[0] <= 0 for x in pair)
    for e, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert e[0] == pytest.approx(top[0][0], abs=TOL) and e[1] == top[0][1]  # greedy picks the top entry

    # streaming: every event carries the entries of the tokens so far, and ends where the plain response does
    r = http.post("/generate", json={**body, "stream": True})
    events = sse(r)
    for ev in events:
        assert len(ev["meta_info"]["output_token_logprobs"]) == len(ev["output_ids"])
    last = events[-1]["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [e[1] for e in last[key]] == [e[1] for e in meta[key]]
        assert [e[0] for e in last[key][1:]] == pytest.approx([e[0] for e in meta[key][1:]], abs=TOL)


def test_native_per_prompt_values(http):
    body = {"text": ["one", "two"], "sampling_params": {"max_new_tokens": 4, **GREEDY},
            "return_logprob": [True, False], "top_logprobs_num": [2, 0], "logprob_start_len": [-1, 0]}  # fmt: skip
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    a, b = r.json()
    assert len(a["meta_info"]["output_token_logprobs"]) == 4 and a["meta_info"]["input_token_logprobs"] == []
    assert all(len(t) == 2 for t in a["meta_info"]["output_top_logprobs"])
    assert "output_token_logprobs" not in b["meta_info"]


def test_completions_logprobs_and_echo(client, tokenizer):
    prompt = "The cat sat"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=2, echo=True, **GREEDY_OAI)
    c = r.choices[0]
    n_prompt = len(tokenizer.encode(prompt))
    assert c.text.startswith(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])

    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=2, **GREEDY_OAI)
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[n_prompt:], abs=TOL)
    echo_only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True, **GREEDY_OAI)
    assert echo_only.choices[0].text == c.text and echo_only.choices[0].logprobs is None

    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n_prompt], abs=TOL)

    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, logprobs=2, echo=True, stream=True, **GREEDY_OAI
    )
    tokens, values, text = [], [], ""
    for ev in stream:
        for ch in ev.choices:
            text += ch.text
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                values += ch.logprobs.token_logprobs
    assert text == c.text and tokens == lp.tokens
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=TOL)


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=7, logprobs=True, top_logprobs=3, **GREEDY_OAI
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=TOL)
        assert bytes(t.bytes).decode() == t.token
    no_top = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=7, logprobs=True, **GREEDY_OAI)
    assert [t.top_logprobs for t in no_top.choices[0].logprobs.content] == [[]] * len(content)
    none = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=7, **GREEDY_OAI)
    assert none.choices[0].logprobs is None

    streamed = []
    for ev in client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=7, logprobs=True, top_logprobs=3, stream=True, **GREEDY_OAI
    ):
        for ch in ev.choices:
            if ch.logprobs is not None and ch.logprobs.content:
                streamed += ch.logprobs.content
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=TOL)


BAD = [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ("/generate", {"text": "hi", "return_logprob": True, "token_ids_logprob": [10**6]}, "token_ids_logprob"),
    ("/generate", {"text": ["a", "b"], "return_logprob": [True]}, "return_logprob"),
]


@pytest.mark.parametrize("path,body,field", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_invalid_values_are_400_naming_the_field(http, path, body, field):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["param"] == field and field in err["message"] and err["type"] == "BadRequestError", err
    assert http.post("/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
