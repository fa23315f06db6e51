"""The prefix cache over HTTP: OpenAI `usage.prompt_tokens_details.cached_tokens`, SGLang `meta_info.cached_tokens`,
the hit-rate counters on /metrics, and /flush_cache dropping the tree (a real launch_server, the `openai` client)."""

from __future__ import annotations

import httpx
import openai

from server_utils import launch_server

SYSTEM = "You answer in the shortest way there is. " * 6


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"treepage:{name} "):
            return float(line.split()[1])
    raise AssertionError(f"treepage:{name} missing from /metrics")


def test_cached_tokens_reported_and_flushed(tiny_llama_dir, tmp_path) -> None:
    args = ["--model-path", tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
            "--page-size", "4", "--max-total-tokens", "8192", "--skip-server-warmup"]  # fmt: skip
    with launch_server(args, tmp_path / "server.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the cat"}]
        kw = {"model": "tiny", "messages": msgs, "max_tokens": 4, "temperature": 0}
        first = client.chat.completions.create(**kw)
        second = client.chat.completions.create(**kw)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        hit = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < hit < second.usage.prompt_tokens and hit % 4 == 0
        assert second.choices[0].message.content == first.choices[0].message.content
        stream = list(
            client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        )
        assert stream[-1].usage.prompt_tokens_details.cached_tokens == hit
        body = {"text": SYSTEM, "sampling_params": {"max_new_tokens": 2}}
        native = [httpx.post(f"{url}/generate", json=body).json()["meta_info"] for _ in range(2)]
        assert native[0]["cached_tokens"] == 0 and native[1]["cached_tokens"] > 0
        text = httpx.get(f"{url}/metrics").text
        assert _metric(text, "cache_hit_tokens_total") > 0
        assert 0 < _metric(text, "cache_hit_rate") < 1
        assert httpx.get(f"{url}/debug/memory").json()["cached_pages"] > 0
        assert httpx.post(f"{url}/flush_cache").status_code == 200
        mem = httpx.get(f"{url}/debug/memory").json()
        assert mem["cached_pages"] == 0 and mem["free_pages"] == mem["total_pages"], mem
        again = client.chat.completions.create(**kw)
        assert again.usage.prompt_tokens_details.cached_tokens == 0
