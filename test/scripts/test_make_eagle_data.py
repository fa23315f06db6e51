"""scripts/make_eagle_data.py: held-out topics never reach training, and the responses are the target's own plain
greedy tokens (never a speculative run's, which would tie the data to the head it trains)."""

from __future__ import annotations

import json

import make_eagle_data as med

from treepage.arg_groups.speculative import apply_default_server_speculation
from treepage.entrypoints.engine import Engine
from treepage.server_args import ServerArgs


def topics_of(p) -> set[str]:
    return set(p.topic.split(" / ")) if p.prompt.startswith("What is the difference") else {p.topic}


def test_heldout_topics_are_disjoint_and_prompts_deterministic():
    prompts = med.build_prompts(400, 64, heldout_frac=0.1, seed=0)
    train = set().union(*(topics_of(p) for p in prompts if p.split == "train"))
    held = set().union(*(topics_of(p) for p in prompts if p.split == "heldout"))
    assert len(held) > 10 and not train & held
    assert len({p.id for p in prompts}) == len(prompts) == 464
    # A smaller request is a prefix of a larger one, so resumed or extended runs keep their earlier prompts.
    small = med.build_prompts(3, 2, heldout_frac=0.1, seed=0)
    assert [p.prompt for p in small if p.split == "train"] == [p.prompt for p in prompts[:3]]


def test_generator_never_speculates_with_the_default_model():
    """The Engine applies the default-model speculation to args with no algorithm; the generator's must opt out."""
    args = med.generator_args(None, "bfloat16")
    apply_default_server_speculation(args)
    assert not args.speculation
    bare = ServerArgs(log_level="warning")
    apply_default_server_speculation(bare)
    assert bare.speculation  # without the override the data would come from a speculative run


def test_responses_are_plain_greedy_and_reruns_resume(tmp_path):
    argv = ["--out", str(tmp_path), "--num-train", "2", "--num-heldout", "1", "--max-new-tokens", "6",
            "--dtype", "float32", "--batch-size", "2"]  # fmt: skip
    manifest = med.main(argv)
    assert manifest["splits"]["train"]["prompts"] == 2 and manifest["splits"]["heldout"]["prompts"] == 1
    assert manifest["decoding"].startswith("plain greedy")
    med.main(argv)  # resumes: nothing is generated twice
    recs = [json.loads(line) for s in ("train", "heldout") for line in open(tmp_path / f"{s}.jsonl")]
    assert len(recs) == 3
    plain = ServerArgs(dtype="float32", speculative_algorithm="NONE", log_level="warning")
    with Engine(plain) as engine:
        for r in recs:
            out = engine.generate(
                input_ids=r["input_ids"], sampling_params={"temperature": 0, "max_new_tokens": 6}
            )
            assert out["output_ids"] == r["output_ids"]
        engine.wait_idle()
        mem = engine.memory_report()
        assert mem["used_pages"] == 0 and mem["used_rows"] == 0
