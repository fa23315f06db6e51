"""Adaptive speculation through a real launch_server: /get_server_info and /metrics report the rounds per
shape (and off), the accept estimates and the calibration table; the calibration is logged."""

from __future__ import annotations

import httpx
import openai

from server_utils import launch_server
from spec_utils import make_eagle_head

SHAPES = ["4x4x16", "3x2x6", "3x1x4", "1x1x2", "off"]


def test_adaptive_server_reports_its_policy(tiny_llama_dir, tmp_path):
    head = make_eagle_head(tiny_llama_dir, str(tmp_path / "eagle3"), "EAGLE3")
    table = tmp_path / "table.json"
    args = ["--model-path", tiny_llama_dir, "--dtype", "float32", "--page-size", "16", "--served-model-name", "x",
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head,
            "--speculative-num-steps", "4", "--speculative-eagle-topk", "4",
            "--speculative-num-draft-tokens", "16",
            "--speculative-adaptive", "--speculative-adaptive-calibration", str(table)]  # fmt: skip
    log = tmp_path / "server.log"
    with launch_server(args, log) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="x", prompt="hello there", max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        assert sum(len(c.choices[0].text) > 0 for c in stream) > 0
        info = httpx.get(f"{url}/get_server_info").json()["speculative_adaptive"]
        assert info["policy"] == "adaptive" and info["candidates"] == SHAPES
        assert sum(info["rounds"].values()) > 0
        assert set(info["accept_estimate"]) == set(SHAPES)
        assert set(info["calibration"]["round_seconds"]) == set(SHAPES)
        text = httpx.get(f"{url}/metrics").text
        for shape in SHAPES:
            assert f'treepage:spec_adaptive_rounds_total{{shape="{shape}"}}' in text, shape
            assert f'treepage:spec_adaptive_accept_estimate{{shape="{shape}"}}' in text, shape
        assert 'treepage:spec_adaptive_round_seconds{batch="1",shape="off"}' in text
    assert table.exists()
    assert "adaptive speculation calibrated" in log.read_text()
