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


def test_dialogue_set_is_the_later_turns_of_held_out_conversations():
    sizes = bench_heads.parse_set_sizes(["sharegpt_turns=all", "sharegpt=4"])
    assert sizes == {"sharegpt_turns": None, "sharegpt": 4}
    dialogs = med.sharegpt_heldout_dialogues(None)
    _, held = sharegpt_split()
    # The held-out conversations that go on, in the held-out order, each with one or two usable later turns.
    assert [p.id for p in dialogs] == [p.id for p in held if p.id in {d.id for d in dialogs}]
    assert len(dialogs) > 50 and all(1 <= len(p.follow_ups) <= 2 for p in dialogs)
    assert all(med.is_heldout(f"{p.topic}_1") and med.Filters().passes(t) for p in dialogs for t in p.follow_ups)
    assert {len(p.follow_ups) for p in dialogs} == {1, 2}
    assert [p.follow_ups for p in med.sharegpt_heldout_dialogues(5, turns=2)] == [
        p.follow_ups[:1] for p in dialogs[:5]
    ]


def test_later_turn_prompts_carry_the_targets_own_replies():
    """Each later turn is prompted with the dialogue so far, every earlier reply the engine's own greedy answer
    of --history-tokens, as a chat client would send it; the order is conversation by conversation."""
    from treepage.managers.tokenizer import apply_chat_template

    dialogs = [
        med.Prompt("sg-a", "heldout", "a", "Name a fruit.", "sharegpt", ["And a vegetable?", "And a nut?"]),
        med.Prompt("sg-b", "heldout", "b", "Say hello.", "sharegpt", ["Now say goodbye."]),
    ]
    sp = {"temperature": 0, "max_new_tokens": 6}
    with Engine(ServerArgs(dtype="float32", speculative_algorithm="NONE", log_level="warning")) as engine:
        got = bench_heads.later_turn_prompts(engine, dialogs, 6, group=2)
        tok = engine.tokenizer
        want = []
        for p in dialogs:
            messages: list[dict] = []
            for user in [p.prompt, *p.follow_ups]:
                messages.append({"role": "user", "content": user})
                ids = apply_chat_template(tok, messages)
                if len(messages) > 1:
                    want.append(ids)
                reply = engine.generate(input_ids=ids, sampling_params=sp)["output_ids"]
                messages.append({"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)})
    assert got == want and len(got) == 3
