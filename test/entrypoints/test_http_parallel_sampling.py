"""n > 1 over real HTTP from a tree-speculative server with the strict memory check, through the official
`openai` client (completions and chat, streamed and not) and SGLang's native /generate: n choices with their
`index`, each equal to the n = 1 request seeded `seed + i`, reproducible run to run, usage counting the prompt
once, logprobs per choice, and a client that goes away mid-stream leaking nothing."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from server_utils import checked_server, tiny_spec_server_args

MODEL = "tiny"
N = 4
SEED = 77
PROMPT = "The cat sat on the mat and then"
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def base(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("http_nsample") / "server.log"
    with checked_server(tiny_spec_server_args(tiny_llama_dir, MODEL, max_total_tokens=16384), log, strict=True) as url:
        yield url


@pytest.fixture(scope="module")
def http(base):
    with httpx.Client(base_url=base, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def sse(resp: httpx.Response) -> list[dict]:
    return [json.loads(x[6:]) for x in resp.text.splitlines() if x.startswith("data: {")]


SAMPLED = {"temperature": 1.0, "max_tokens": 10, "extra_body": {"ignore_eos": True}}


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=N, seed=SEED, logprobs=2, **SAMPLED)
    assert [c.index for c in r.choices] == list(range(N))
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1
    singles = [client.completions.create(model=MODEL, prompt=PROMPT, seed=SEED + i, logprobs=2, **SAMPLED)
               for i in range(N)]  # fmt: skip
    assert texts == [s.choices[0].text for s in singles]
    for c, s in zip(r.choices, singles):  # logprobs per choice
        assert c.logprobs.tokens == s.choices[0].logprobs.tokens
        assert c.logprobs.token_logprobs == pytest.approx(s.choices[0].logprobs.token_logprobs, abs=1e-4)
    prompt_tokens = singles[0].usage.prompt_tokens
    assert r.usage.prompt_tokens == prompt_tokens  # the prompt once
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) == N * 10
    again = client.completions.create(model=MODEL, prompt=PROMPT, n=N, seed=SEED, **SAMPLED)
    assert [c.text for c in again.choices] == texts  # reproducible
    # streamed: chunks carry their choice's index; the usage chunk counts the prompt once
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, n=N, seed=SEED, stream=True, stream_options={"include_usage": True}, **SAMPLED
    )
    got, finish, usage = [""] * N, [None] * N, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            got[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert got == texts and finish == ["length"] * N
    assert usage is not None and usage.prompt_tokens == prompt_tokens and usage.completion_tokens == N * 10
    # two prompts: choice index = prompt * n + sample
    two = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello there"], n=2, seed=SEED, **SAMPLED)
    other = client.completions.create(model=MODEL, prompt="Hello there", n=2, seed=SEED, **SAMPLED)
    assert [c.text for c in two.choices] == texts[:2] + [c.text for c in other.choices]
    assert two.usage.prompt_tokens == prompt_tokens + other.usage.prompt_tokens


def test_chat(client):
    kw = {"model": MODEL, "messages": CHAT, "n": N, "seed": SEED, "logprobs": True, "top_logprobs": 2, **SAMPLED}
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == list(range(N))
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1
    for i, c in enumerate(r.choices):
        s = client.chat.completions.create(**{**kw, "n": 1, "seed": SEED + i}).choices[0]
        assert c.message.content == s.message.content
        assert [t.token for t in c.logprobs.content] == [t.token for t in s.logprobs.content]
    assert r.usage.completion_tokens == N * 10
    assert r.usage.prompt_tokens == client.chat.completions.create(**{**kw, "n": 1}).usage.prompt_tokens
    got, roles = [""] * N, set()
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            got[c.index] += c.delta.content or ""
    assert got == texts and roles == set(range(N))
    greedy = client.chat.completions.create(**{**kw, "temperature": 0})
    assert len({c.message.content for c in greedy.choices}) == 1  # greedy: n identical outputs


def test_generate(http):
    params = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": SEED}
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {**params, "n": N}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and [o["index"] for o in outs] == list(range(N))
    for i, o in enumerate(outs):
        s = http.post("/generate", json={"text": PROMPT, "sampling_params": {**params, "sampling_seed": SEED + i}})
        assert o["output_ids"] == s.json()["output_ids"]
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {**params, "n": N}, "stream": True})
    final = {}
    for ev in sse(r):
        final[ev["index"]] = ev["output_ids"]
    assert [final[i] for i in range(N)] == [o["output_ids"] for o in outs]
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {**params, "n": 1}})
    assert isinstance(r.json(), dict)  # n = 1 keeps the single-result shape


def test_disconnect_mid_stream_aborts_every_sample(base, http):
    body = {"model": MODEL, "prompt": PROMPT, "n": N, "seed": SEED, "max_tokens": 2000, "temperature": 1.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.Client(base_url=base, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as resp:
        seen = set()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                seen.update(ch["index"] for ch in json.loads(line[6:])["choices"])
            if len(seen) == N:
                break
    deadline = time.monotonic() + 20
    while (mem := http.get("/debug/memory").json())["used_rows"] or mem["used_pages"]:
        assert time.monotonic() < deadline, mem
        time.sleep(0.05)
