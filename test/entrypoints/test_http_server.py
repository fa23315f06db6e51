"""End to end: the official `openai` client and raw HTTP against a real launch_server subprocess (tiny model)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from server_utils import launch_server, log_tail

MODEL = "tiny"
GREEDY = {"temperature": 0, "ignore_eos": True}


@dataclass
class Server:
    url: str
    log: Path


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("http_server") / "server.log"
    args = ["--model-path", tiny_llama_dir, "--served-model-name", MODEL, "--dtype", "float32",
            "--page-size", "4", "--max-total-tokens", "8192"]  # fmt: skip
    with launch_server(args, log) as url:
        yield Server(url, log)
    assert "Traceback" not in log.read_text(errors="replace"), log_tail(log, 200)  # no hidden 500s or crashes


def _memory(url: str) -> dict:
    return httpx.get(f"{url}/debug/memory", timeout=10).json()


def assert_no_leaks(server: Server, timeout: float = 10.0) -> None:
    """The scheduler frees asynchronously: poll until idle, then demand zero pages and rows in use."""
    deadline = time.monotonic() + timeout
    while (mem := _memory(server.url))["used_pages"] or mem["used_rows"]:
        if time.monotonic() > deadline:
            pytest.fail(f"KV leak or stuck request: {mem}\n{log_tail(server.log)}")
        time.sleep(0.05)


@pytest.fixture
def url(server):
    """The server URL; after the test, the server must be alive and hold no KV."""
    yield server.url
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200, log_tail(server.log)
    assert_no_leaks(server)


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def generate(url: str, **body) -> dict | list:
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(lines) -> list:
    """Payloads of `data:` lines; the literal [DONE] stays a string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def gen_tokens_total(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("treepage:generation_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("treepage:generation_tokens_total missing from /metrics")


# ---- OpenAI routes -------------------------------------------------------------------------------------------
def test_completion_matches_native_generate(client, url, tokenizer):
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == MODEL
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode("the cat"))
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6
    native = generate(url, text="the cat", sampling_params={"max_new_tokens": 6, **GREEDY})
    assert choice.text == native["text"] and len(native["output_ids"]) == 6


def test_completion_token_prompt_and_default_model_name(client, url, tokenizer):
    ids = tokenizer.encode("hello")
    r = client.completions.create(model="default", prompt=ids, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    native = generate(url, text="hello", sampling_params={"max_new_tokens": 3, **GREEDY})
    assert r.choices[0].text == native["text"] and r.usage.prompt_tokens == len(ids)


def test_completion_batch_prompt_keeps_order(client, url):
    r = client.completions.create(model=MODEL, prompt=["a", "b c"], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    for prompt, choice in zip(["a", "b c"], r.choices):
        assert (
            choice.text == generate(url, text=prompt, sampling_params={"max_new_tokens": 3, **GREEDY})["text"]
        )
    assert r.usage.completion_tokens == 6
    texts = ["", ""]
    stream = client.completions.create(model=MODEL, prompt=["a", "b c"], max_tokens=3, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]


def test_chat_uses_the_chat_template(client, url, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == len(ids)
    native = generate(url, input_ids=ids, sampling_params={"max_new_tokens": 5, **GREEDY})
    assert choice.message.content == native["text"]


def test_chat_default_max_tokens_fills_the_context(client):
    long = "x" * 480
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 512  # the tiny model's context


def test_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="hello world", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_stream_equals_non_stream(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "tell me"}], max_tokens=7, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_stop_string_trims_and_streams_identically(client, url):
    ref = generate(url, text="hello world", sampling_params={"max_new_tokens": 12, **GREEDY})["text"]
    assert len(ref) >= 6, ref
    stop = ref[len(ref) // 2 :][:2]
    expected = ref[: ref.find(stop)]
    kw = dict(model=MODEL, prompt="hello world", max_tokens=12, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})  # fmt: skip
    r = client.completions.create(**kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == expected


def test_stop_token_ids(client, url):
    # A prompt whose greedy continuation runs at least 3 tokens before EOS (the random model often ends early).
    for prompt in ("hello world", "the cat", "abc", "xyz"):
        ids = generate(url, text=prompt, sampling_params={"max_new_tokens": 10, "temperature": 0})[
            "output_ids"
        ]
        if len(ids) >= 3:
            break
    assert len(ids) >= 3, ids
    stop_id = ids[2]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id]})  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == ids.index(stop_id) + 1


def test_eight_concurrent_requests(client):
    def one(i: int):
        return client.completions.create(model=MODEL, prompt=f"request number {i}", max_tokens=8, temperature=0.7,
                                         seed=i, extra_body={"ignore_eos": True})  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert len({r.id for r in results}) == 8
    for r in results:
        assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model=MODEL, prompt="once upon", max_tokens=8, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})  # fmt: skip
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_client_disconnect_mid_stream_aborts(url, server):
    before = gen_tokens_total(url)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 500, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        n = 0
        for line in resp.iter_lines():
            n += line.startswith("data: ")
            if n == 2:
                break
    assert_no_leaks(server)
    assert gen_tokens_total(url) - before < 500, (
        "the request ran to completion: the disconnect did not abort it"
    )
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_client_timeout_on_non_stream_request_aborts(url, server):
    before = gen_tokens_total(url)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 500, **GREEDY}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.05))
    assert_no_leaks(server)
    assert gen_tokens_total(url) - before < 500, "the request ran to completion after its client left"


def test_abort_request_ends_the_stream_with_an_error(url):
    body = {"prompt": "abc", "max_tokens": 500, "stream": True, "rid": "abort-me", **GREEDY}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert httpx.post(f"{url}/abort_request", json={"rid": "abort-me"}, timeout=10).status_code == 200
        events = sse_events([first, *lines])
    assert events[-1] == "[DONE]"
    assert "aborted" in events[-2]["error"]["message"] and events[-2]["error"]["code"] == 503


# ---- bad input -----------------------------------------------------------------------------------------------
CHAT = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("/v1/completions", '{"prompt": "hi",', 400, "not valid JSON"),
    ("/v1/completions", "[1, 2]", 400, "object"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/completions", {"prompt": "hi", "bogus": 1}, 400, "bogus"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "four"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_new_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1, "stream": True}, 400, "max_new_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "context length"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**9, "stream": True}, 400, "context length"),
    ("/v1/completions", {"prompt": "x" * 600, "max_tokens": 1}, 400, "context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 600}]}, 400, "context length"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    ("/v1/completions", {"prompt": [999999]}, 400, "input_ids"),
    ("/v1/chat/completions", {"messages": []}, 400, "empty"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n must be"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, 400, "n must be"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, 400, "same for every prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 2}, 400, "best_of=2"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": 0}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "gpt-4"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}, 404, "does not exist"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, 400, "text"),
    ("/generate", {"text": "hi", "input_ids": [1]}, 400, "exactly one"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, 400, "bogus"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "x"}}, 400, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ("/generate", {"input_ids": [[1, 2], []]}, 400, "empty"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params"),
]


@pytest.mark.parametrize(
    "path,body,status,fragment", BAD_REQUESTS, ids=[f"{i}{c[0]}-{c[3]}" for i, c in enumerate(BAD_REQUESTS)]
)
def test_bad_input_is_a_clean_client_error(url, path, body, status, fragment):
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, str)
        else {"json": body}
    )
    r = httpx.post(f"{url}{path}", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"object", "message", "type", "param", "code"}, err
    assert err["object"] == "error" and err["code"] == status
    assert err["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert fragment.lower() in err["message"].lower(), err["message"]


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="n must be"):
        client.completions.create(model=MODEL, prompt="hi", n=17)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    r = client.completions.create(model=MODEL, prompt="still serving", max_tokens=2)
    assert r.usage.completion_tokens <= 2


# ---- native and admin routes ------------------------------------------------------------------------------
def test_generate_single_batch_and_rid(url, tokenizer):
    one = generate(url, text="a", rid="my-rid", sampling_params={"max_new_tokens": 4, **GREEDY})
    assert set(one) == {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert meta["id"] == "my-rid" and meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["completion_tokens"] == 4 and meta["prompt_tokens"] == len(tokenizer.encode("a"))
    two = generate(url, text="b c", sampling_params={"max_new_tokens": 3, **GREEDY})
    batch = generate(url, input_ids=[tokenizer.encode("a"), tokenizer.encode("b c")],
                     sampling_params=[{"max_new_tokens": 4, **GREEDY}, {"max_new_tokens": 3, **GREEDY}])  # fmt: skip
    assert [b["output_ids"] for b in batch] == [one["output_ids"], two["output_ids"]]


def test_generate_stream_is_cumulative(url):
    body = {"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 6, **GREEDY}}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    snaps = events[:-1]
    for prev, cur in zip(snaps, snaps[1:]):
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
    assert snaps[-1]["meta_info"]["finish_reason"]["type"] == "length"
    final = generate(url, text="hello", sampling_params={"max_new_tokens": 6, **GREEDY})
    assert snaps[-1]["output_ids"] == final["output_ids"] and snaps[-1]["text"] == final["text"]


def test_generate_batch_stream_has_indices(url):
    body = {"text": ["a", "b"], "stream": True, "sampling_params": {"max_new_tokens": 3, **GREEDY}}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as resp:
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    finished = {e["index"]: e for e in events[:-1] if e["meta_info"]["finish_reason"]}
    assert sorted(finished) == [0, 1]
    assert all(len(e["output_ids"]) == 3 for e in finished.values())


def test_models_health_info_and_flush(client, url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{url}/v1/models/{MODEL}").json()["max_model_len"] == 512
    assert httpx.get(f"{url}/v1/models/other").status_code == 404
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
    for path in ("/get_server_info", "/server_info"):
        info = httpx.get(f"{url}{path}").json()
        assert info["context_length"] == 512 and info["page_size"] == 4 and info["served_model_name"] == MODEL
        assert info["dtype"] == "float32" and info["dtype_reason"] == "--dtype float32"
    model_info = httpx.get(f"{url}/get_model_info").json()
    assert model_info["architectures"] == ["LlamaForCausalLM"] and model_info["is_generation"] is True
    for method in ("POST", "GET"):
        r = httpx.request(method, f"{url}/flush_cache")
        assert r.status_code == 200 and "flushed" in r.text.lower()


def test_metrics_are_prometheus_text_and_move(client, url):
    before = gen_tokens_total(url)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})  # fmt: skip
    text = httpx.get(f"{url}/metrics").text
    for name in ("num_running_reqs", "num_queue_reqs", "gen_throughput", "token_usage", "avg_spec_accept_length",
                 "prompt_tokens_total", "generation_tokens_total"):  # fmt: skip
        assert f"\ntreepage:{name} " in text, name
    assert gen_tokens_total(url) - before == 5



def test_full_queue_is_503_and_frees_everything(tiny_llama_dir, tmp_path):
    """A batch larger than --max-queued-requests allows: 503, and the part already queued is aborted."""
    args = ["--model-path", tiny_llama_dir, "--max-running-requests", "1", "--max-queued-requests", "1",
            "--skip-server-warmup"]  # fmt: skip
    log = tmp_path / "server.log"
    with launch_server(args, log) as base:
        body = {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 50, **GREEDY}}
        r = httpx.post(f"{base}/generate", json=body, timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["type"] == "ServiceUnavailableError" and "queue" in r.json()["message"]
        assert_no_leaks(Server(base, log))
        again = generate(base, text="a", sampling_params={"max_new_tokens": 2})
        assert again["meta_info"]["completion_tokens"] <= 2
    assert "Traceback" not in log.read_text(errors="replace"), log_tail(log, 200)
