"""Scale-out with SGLang's own tools: two treepage workers (one plain, one with tree speculation) behind
sglang-router, driven by the official `openai` client and httpx; and `sglang.bench_serving --backend sglang`
against a treepage worker."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_utils import launch_server, log_tail
from sglang_tools import launch_router, run_bench_serving

pytestmark = pytest.mark.slow

MODEL = "tiny"
NUM_STEPS = 3
MAX_TOKENS = 6
CHAT = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


def _worker_args(model_dir: str, speculative: bool) -> list[str]:
    args = ["--model-path", model_dir, "--served-model-name", MODEL, "--dtype", "float32", "--page-size", "4",
            "--max-total-tokens", "8192"]  # fmt: skip
    if not speculative:
        return [*args, "--speculative-algorithm", "NONE"]
    return [*args, "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", model_dir,
            "--speculative-num-steps", str(NUM_STEPS), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(NUM_STEPS + 1)]  # fmt: skip


@pytest.fixture(scope="module")
def workers(tiny_llama_dir, tmp_path_factory):
    """(plain URL, speculative URL)."""
    logs = tmp_path_factory.mktemp("scale_out")
    with (
        launch_server(_worker_args(tiny_llama_dir, speculative=False), logs / "plain.log") as plain,
        launch_server(_worker_args(tiny_llama_dir, speculative=True), logs / "spec.log") as spec,
    ):
        yield plain, spec
    for name in ("plain.log", "spec.log"):
        text = (logs / name).read_text(errors="replace")
        assert "Traceback" not in text, log_tail(logs / name, 200)


# ---- one request of each kind, as a user sends it --------------------------------------------------------------
def _chat(client: openai.OpenAI, base: str) -> str:
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert r.usage.completion_tokens == MAX_TOKENS
    return r.choices[0].message.content


def _chat_stream(client: openai.OpenAI, base: str) -> str:
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _completion(client: openai.OpenAI, base: str) -> str:
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.usage.completion_tokens == MAX_TOKENS
    return r.choices[0].text


def _completion_stream(client: openai.OpenAI, base: str) -> str:
    chunks = client.completions.create(model=MODEL, prompt="the cat", max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _generate(client: openai.OpenAI, base: str) -> str:
    body = {"text": "the dog", "sampling_params": {"max_new_tokens": MAX_TOKENS, **GREEDY}}
    r = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == MAX_TOKENS
    return r.json()["text"]


def _generate_stream(client: openai.OpenAI, base: str) -> str:
    body = {"text": "the dog", "stream": True, "sampling_params": {"max_new_tokens": MAX_TOKENS, **GREEDY}}
    with httpx.stream("POST", f"{base}/generate", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["text"]  # cumulative


KINDS: dict[str, Callable[[openai.OpenAI, str], str]] = {
    "chat": _chat,
    "chat-stream": _chat_stream,
    "completion": _completion,
    "completion-stream": _completion_stream,
    "generate": _generate,
    "generate-stream": _generate_stream,
}


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _generation_tokens(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("treepage:generation_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("treepage:generation_tokens_total missing from /metrics")


def test_two_workers_serve_behind_sglang_router(workers, tmp_path):
    plain, spec = workers
    # the answer each kind must get: speculation in fp32 produces exactly plain greedy's tokens
    expected = {kind: fn(_client(plain), plain) for kind, fn in KINDS.items()}
    assert all(expected.values()), expected
    before = {url: _generation_tokens(url) for url in workers}
    with launch_router(list(workers), tmp_path / "router.log") as gateway:
        client = _client(gateway)
        assert [m.id for m in client.models.list().data] == [MODEL]
        for kind, fn in KINDS.items():
            for _ in range(2):  # round robin: consecutive requests go to different workers
                assert fn(client, gateway) == expected[kind], kind
        served = {url: _generation_tokens(url) - before[url] for url in workers}
        assert all(n > 0 for n in served.values()), served
        assert sum(served.values()) == 2 * len(KINDS) * MAX_TOKENS, served
        _router_reads_get_load(gateway, plain)
    assert "panicked" not in (tmp_path / "router.log").read_text(errors="replace")


def _router_reads_get_load(gateway: str, busy_worker: str) -> None:
    """The router's /get_loads reports each worker's /get_load num_tokens: a batch on one worker shows there."""
    body = {"text": ["hi"] * 16, "sampling_params": {"max_new_tokens": 240, **GREEDY}}
    with ThreadPoolExecutor(1) as pool:
        batch = pool.submit(httpx.post, f"{busy_worker}/generate", json=body, timeout=300)
        seen: list[dict[str, int]] = []
        while not batch.done():
            seen.append(
                {
                    w["worker"]: w["load"]
                    for w in httpx.get(f"{gateway}/get_loads", timeout=10).json()["workers"]
                }
            )
        assert batch.result().status_code == 200
    assert any(loads[busy_worker] > 0 for loads in seen), seen
    assert all(sum(loads.values()) == loads[busy_worker] for loads in seen), seen


def test_bench_serving_sglang_backend(workers, tiny_llama_dir, tmp_path):
    _, spec = workers
    out = tmp_path / "bench.jsonl"
    num_prompts, output_len = 8, 8
    proc = run_bench_serving(["--backend", "sglang", "--base-url", spec, "--model", MODEL,
                              "--tokenizer", tiny_llama_dir, "--dataset-name", "random-ids",
                              "--num-prompts", str(num_prompts), "--random-input-len", "16",
                              "--random-output-len", str(output_len), "--random-range-ratio", "1",
                              "--output-file", str(out), "--disable-tqdm", "--seed", "1"])  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["backend"] == "sglang" and result["completed"] == num_prompts
    assert result["total_output_tokens"] == num_prompts * output_len  # read from meta_info.completion_tokens
    (state,) = httpx.get(f"{spec}/server_info", timeout=10).json()["internal_states"]
    assert result["accept_length"] == state["avg_spec_accept_length"] > 2  # the draft is the target
    assert "Accept length:" in proc.stdout
