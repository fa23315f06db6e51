"""Tree speculative decoding on paged KV through the real HTTP server, driven by the official openai client.

Each class launches a speculative server and a plain server on the same tiny target and checks, with the
strict memory check on (every scheduler step): greedy equivalence, 8 concurrent clients, a client that aborts
mid-stream, a shared-prefix batch, a multi-turn conversation that grows until the context limit, and a long
prompt near the context limit; after each test the page and row accounting is back to zero.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_utils import launch_server
from spec_utils import make_eagle_head, make_sharp_target

CONTEXT = 512


def _memory(url: str) -> dict:
    return httpx.get(f"{url}/debug/memory", timeout=10).json()


def assert_no_leaks(url: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        mem = _memory(url)
        if mem["used_pages"] == 0 and mem["used_rows"] == 0:
            return
        assert time.monotonic() < deadline, mem
        time.sleep(0.1)


def generate_ids(url: str, input_ids, max_new_tokens: int = 24) -> list:
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    r = httpx.post(f"{url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    return [o["output_ids"] for o in out] if isinstance(out, list) else out["output_ids"]


class _SpecServerSuite:
    ALGORITHM: str
    FLAGS: list[str]

    @pytest.fixture(scope="class")
    @classmethod
    def servers(cls, tmp_path_factory):
        self = cls
        root = tmp_path_factory.mktemp(self.ALGORITHM.lower())
        target = make_sharp_target(str(root / "target"))
        head = make_eagle_head(target, str(root / "head"), self.ALGORITHM)
        old = os.environ.get("TREEPAGE_STRICT_MEM_CHECK")
        os.environ["TREEPAGE_STRICT_MEM_CHECK"] = "1"
        common = ["--model-path", target, "--dtype", "float32", "--context-length", str(CONTEXT)]
        spec = common + [
            "--speculative-algorithm",
            self.ALGORITHM,
            "--speculative-draft-model-path",
            head,
            *self.FLAGS,
        ]
        try:
            with (
                launch_server(spec, root / "spec.log") as spec_url,
                launch_server(common, root / "plain.log") as plain_url,
            ):
                yield spec_url, plain_url
        finally:
            if old is None:
                os.environ.pop("TREEPAGE_STRICT_MEM_CHECK", None)
            else:
                os.environ["TREEPAGE_STRICT_MEM_CHECK"] = old

    @pytest.fixture
    def clients(self, servers):
        spec_url, plain_url = servers
        yield (
            openai.OpenAI(base_url=f"{spec_url}/v1", api_key="x", max_retries=0),
            openai.OpenAI(base_url=f"{plain_url}/v1", api_key="x", max_retries=0),
        )
        assert_no_leaks(spec_url)

    def test_server_reports_the_configuration(self, servers):
        spec_url, _ = servers
        info = httpx.get(f"{spec_url}/get_server_info", timeout=10).json()
        for key, value in self.EXPECTED.items():
            assert info[key] == value, (key, info[key])

    def test_greedy_equivalence(self, servers, clients):
        spec_url, plain_url = servers
        prompts = [
            [3 + (i * 11 + j) % 120 for j in range(n)] for i, n in enumerate((1, 3, 4, 63, 64, 65, 130))
        ]
        assert generate_ids(spec_url, prompts, 40) == generate_ids(plain_url, prompts, 40)
        spec, plain = clients
        kw = dict(model="default", prompt="the cat sat on the", max_tokens=32, temperature=0)
        assert spec.completions.create(**kw).choices[0].text == plain.completions.create(**kw).choices[0].text
        info = httpx.get(f"{spec_url}/get_server_info", timeout=10).json()
        assert info["avg_spec_accept_length"] >= 1.0

    def test_eight_concurrent_clients(self, clients):
        spec, plain = clients

        def chat(client, i):
            msgs = [{"role": "user", "content": f"question {i}: tell me about the sea"}]
            r = client.chat.completions.create(model="default", messages=msgs, max_tokens=24, temperature=0)
            return r.choices[0].message.content

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: chat(spec, i), range(8)))
        assert got == [chat(plain, i) for i in range(8)]

    def test_client_aborts_mid_stream(self, servers, clients):
        spec_url, _ = servers
        body = {
            "model": "default",
            "prompt": "once upon a time",
            "max_tokens": 200,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{spec_url}/v1/completions", json=body, timeout=60) as r:
            chunks = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    if chunks == 2:
                        break
        assert_no_leaks(spec_url)
        spec, plain = clients  # still serving, still exact
        kw = dict(model="default", prompt="after the abort", max_tokens=16, temperature=0)
        assert spec.completions.create(**kw).choices[0].text == plain.completions.create(**kw).choices[0].text

    def test_shared_prefix_batch(self, servers, clients):
        spec_url, plain_url = servers
        prefix = [5 + (j * 3) % 100 for j in range(70)]
        batch = [prefix + [7 + i] * (i + 1) for i in range(6)]
        assert generate_ids(spec_url, batch, 24) == generate_ids(plain_url, batch, 24)

    def test_multi_turn_until_the_context_limit(self, clients):
        spec, plain = clients
        history = [{"role": "user", "content": "let us talk about rivers and the sea"}]
        turns = 0
        while True:
            kw = dict(model="default", messages=history, max_tokens=24, temperature=0)
            try:
                a = spec.chat.completions.create(**kw).choices[0].message.content
            except openai.BadRequestError as err:  # the conversation no longer fits the context
                assert "context length" in str(err)
                with pytest.raises(openai.BadRequestError):
                    plain.chat.completions.create(**kw)
                break
            assert a == plain.chat.completions.create(**kw).choices[0].message.content
            history += [
                {"role": "assistant", "content": a},
                {"role": "user", "content": "and then what happened next in the story?"},
            ]
            turns += 1
            assert turns < 40
        assert turns >= 4

    def test_long_prompt_near_the_context_limit(self, servers):
        spec_url, plain_url = servers
        prompt = [3 + (j * 13) % 120 for j in range(CONTEXT - 20)]
        assert generate_ids(spec_url, prompt, 19) == generate_ids(plain_url, prompt, 19)
        r = httpx.post(
            f"{spec_url}/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 40}}
        )
        assert r.status_code == 400 and "context length" in r.json()["message"]
        assert_no_leaks(spec_url)


class TestEagle3Page64Topk8(_SpecServerSuite):
    ALGORITHM = "EAGLE3"
    FLAGS = [
        "--speculative-num-steps",
        "5",
        "--speculative-eagle-topk",
        "8",
        "--speculative-num-draft-tokens",
        "32",
        "--page-size",
        "64",
    ]
    EXPECTED = {
        "speculative_algorithm": "EAGLE3",
        "speculative_eagle_topk": 8,
        "speculative_num_steps": 5,
        "speculative_num_draft_tokens": 32,
        "page_size": 64,
        "spec_version": 2,
    }


class TestEagleLlama2Page4Topk8(_SpecServerSuite):
    ALGORITHM = "EAGLE"
    FLAGS = [
        "--speculative-num-steps",
        "5",
        "--speculative-eagle-topk",
        "8",
        "--speculative-num-draft-tokens",
        "64",
        "--page-size",
        "4",
        "--disable-overlap-schedule",
    ]
    EXPECTED = {
        "speculative_algorithm": "EAGLE",
        "speculative_eagle_topk": 8,
        "speculative_num_steps": 5,
        "speculative_num_draft_tokens": 64,
        "page_size": 4,
        "spec_version": 1,
    }
