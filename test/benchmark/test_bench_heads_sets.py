"""benchmark/bench_heads.py --acceptance: its three prompt sets are outside every head's training data, and its
decoding loop returns each request's whole output (the engine streams deltas)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))

import bench_heads  # noqa: E402
import make_eagle_data as med  # noqa: E402
import pytest  # noqa: E402
from everyday_prompts import EVERYDAY_PROMPTS  # noqa: E402

from treepage.entrypoints.engine import Engine  # noqa: E402
from treepage.server_args import ServerArgs  # noqa: E402


@functools.cache
def sharegpt_split() -> tuple[list, list]:
    """The data generator's ShareGPT training and held-out prompts (the packaged file is read once)."""
    read, _ = med.load_packaged_sharegpt()
    exclude = {med.normalize(q) for q in EVERYDAY_PROMPTS}
    train, held, _ = med.sharegpt_prompts(read.conversations, med.Filters(), med.SEED, exclude)
    return train, held


def test_acceptance_sets_are_held_out_and_varied():
    sets = bench_heads.prompt_sets(["sharegpt", "old", "everyday"], 16)
    assert all(len(qs) == 16 for qs in sets.values())
    # The ShareGPT set is the generator's held-out list (what heldout.jsonl holds), never its training pool.
    train, held = sharegpt_split()
    assert sets["sharegpt"] == [p.prompt for p in held[:16]]
    assert not {med.normalize(q) for q in sets["sharegpt"]} & {med.normalize(p.prompt) for p in train}
    assert sets["old"] == med.heldout_questions(16)
    # The hand-written subset spreads over the whole list (every kind), not just its first entries.
    picked = [EVERYDAY_PROMPTS.index(q) for q in sets["everyday"]]
    assert picked == sorted(set(picked)) and picked[-1] >= len(EVERYDAY_PROMPTS) - 3


def test_whole_sets_and_sizes_per_set():
    sizes = bench_heads.parse_set_sizes(["sharegpt=all", "everyday=all", "old=20"])
    assert sizes == {"sharegpt": None, "everyday": None, "old": 20}
    assert bench_heads.parse_set_sizes(["12"]) == 12
    with pytest.raises(ValueError, match="NAME=COUNT"):
        bench_heads.parse_set_sizes(["web=all"])
    sets = bench_heads.prompt_sets(["sharegpt", "everyday", "old"], sizes)
    assert sets["everyday"] == EVERYDAY_PROMPTS  # the whole hand-written set, each once
    assert len(sets["old"]) == 20
    _, held = sharegpt_split()
    assert sets["sharegpt"] == [p.prompt for p in held] and len(held) > 100  # the whole held-out split
    assert len(med.heldout_questions(None)) > 200


@pytest.mark.parametrize("group", [1, 3])
def test_decode_set_returns_whole_outputs(tiny_llama_dir, group):
    prompts = [[5, 9, 33, 40], [7, 7, 8], [60, 61, 62, 63, 64], [12, 20]]
    args = ServerArgs(model_path=tiny_llama_dir, dtype="float32", log_level="warning")
    with Engine(args) as engine:
        got = bench_heads.decode_set(engine, prompts, 12, 0.0, group)
        want = [
            engine.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 12})["output_ids"]
            for p in prompts
        ]
    assert got["outputs"] == want and all(len(o) > 1 for o in want)
    assert got["accept_len"] is None and got["accept_len_per_prompt"] is None  # no speculation, no rounds
