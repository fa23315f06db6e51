"""The CLI: start-up mistakes exit cleanly naming the flag; the default embedded model answers a chat."""

from __future__ import annotations

import openai
import pytest

from server_utils import launch_server, run_launch_server

SPEC_TOPK8_P64 = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "X",
                  "--speculative-eagle-topk", "8", "--page-size", "64", "--attention-backend", "sdpa"]  # fmt: skip


def _assert_clean_failure(proc, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, (fragment, proc.stderr)


@pytest.mark.parametrize(
    "extra,fragments",
    [
        (["--page-size", "3"], ["--page-size", "power of two"]),
        (["--attention-backend", "nope"], ["--attention-backend", "nope"]),
        (["--page-size", "0"], ["--page-size"]),
        # Without --speculative-num-steps the resolver refuses the partial tree first, naming that flag.
        (SPEC_TOPK8_P64, ["--speculative-num-steps"]),
        (SPEC_TOPK8_P64 + ["--speculative-num-steps", "3"], ["--attention-backend sdpa", "triton"]),
    ],
    ids=["page-size-3", "unknown-backend", "page-size-0", "spec-no-steps", "spec-sdpa-refused"],
)
def test_bad_flags_exit_naming_the_flag(tiny_llama_dir, extra, fragments):
    _assert_clean_failure(run_launch_server(["--model-path", tiny_llama_dir, *extra]), *fragments)


def test_missing_model_exits_naming_model_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    _assert_clean_failure(run_launch_server(["--model-path", missing]), "--model-path", missing)


@pytest.mark.slow
def test_default_model_answers_capital_of_france(tmp_path):
    with launch_server([], tmp_path / "server.log", startup_timeout=180) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=32,
        )
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer
