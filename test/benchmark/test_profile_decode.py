"""benchmark/common.py profile_decode: the per-step breakdown the benchmarks publish attributes time to the right
parts (a plain step has no speculative round; a spec round has one target forward and S - 1 + 1 draft forwards)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from spec_utils import make_eagle_head
from treepage.entrypoints.engine import Engine
from treepage.server_args import ServerArgs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
from common import profile_decode  # noqa: E402

NEW = 8


@pytest.fixture(scope="module")
def head(tiny_llama3_dir, tmp_path_factory) -> str:
    return make_eagle_head(tiny_llama3_dir, str(tmp_path_factory.mktemp("eagle3")), "EAGLE3")


def prompts() -> list[list[int]]:
    return [[5, 9, 17, 33, 4, 8], [7, 3, 11, 2, 40, 41, 42, 43, 44, 45]]


def test_plain_steps_are_one_target_forward_each(tiny_llama3_dir):
    eng = Engine(ServerArgs(model_path=tiny_llama3_dir, dtype="float32", page_size=4))
    prof = profile_decode(eng, prompts(), NEW)
    parts, calls = prof["parts_ms_per_step"], prof["calls_per_step"]
    assert prof["steps"] == NEW - 1 and prof["tokens"] == 2 * (NEW - 1) and prof["tokens_per_step"] == 2
    assert calls["target forward: decode, or verify of N tree tokens (Llama forward + logits)"] == 1
    assert parts["speculative round (EagleWorker.run_round)"] == 0
    assert 0 < parts["target forward: decode, or verify of N tree tokens (Llama forward + logits)"]
    assert (
        parts["target forward: decode, or verify of N tree tokens (Llama forward + logits)"]
        <= parts["scheduler step (everything)"]
    )


def test_spec_rounds_split_into_draft_and_verify(tiny_llama3_dir, head):
    S = 3
    args = ServerArgs(
        model_path=tiny_llama3_dir,
        dtype="float32",
        page_size=4,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=head,
        speculative_num_steps=S,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=6,
        disable_overlap_schedule=True,
    )
    prof = profile_decode(Engine(args), prompts(), NEW)
    parts, calls = prof["parts_ms_per_step"], prof["calls_per_step"]
    assert prof["tokens"] == 2 * (NEW - 1) and prof["tokens_per_step"] >= 2
    assert calls["speculative round (EagleWorker.run_round)"] == 1
    assert calls["target forward: decode, or verify of N tree tokens (Llama forward + logits)"] == 1
    # S - 1 tree steps + one draft extend per round, each with one lm_head + top-K
    assert calls["draft head forwards: tree steps + extend (EAGLE-3 / EAGLE layers)"] == S
    assert calls["draft lm_head + softmax + top-K (tree steps + extend)"] == S
    assert calls["prefix-tail duplication (holey layout)"] == 1 and calls["build_tree"] == 1
    inner = sum(
        parts[k]
        for k in (
            "target forward: decode, or verify of N tree tokens (Llama forward + logits)",
            "draft head forwards: tree steps + extend (EAGLE-3 / EAGLE layers)",
        )
    )
    assert (
        0
        < inner
        <= parts["speculative round (EagleWorker.run_round)"]
        <= parts["scheduler step (everything)"]
    )
