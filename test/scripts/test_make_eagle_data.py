"""scripts/make_eagle_data.py: the ShareGPT reader survives a truncated file, held-out conversations never reach
training, duplicates and the hand-written benchmark prompts are dropped, runs resume (also after a kill
mid-line), the responses are the target's own plain greedy tokens (never a speculative run's), and
self-written requests are the target's own seeded samples."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import make_eagle_data as med

from treepage.arg_groups.speculative import apply_default_server_speculation
from treepage.entrypoints.engine import Engine
from treepage.server_args import ServerArgs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
from everyday_prompts import EVERYDAY_PROMPTS  # noqa: E402

WORDS = "cook travel bake write explain plan fix learn paint sing".split()


def conv(cid: str, text: str, first: str = "human") -> dict:
    return {"id": cid, "conversations": [{"from": first, "value": text}, {"from": "gpt", "value": "Sure."}]}


def chat_corpus(n: int) -> list[dict]:
    """n distinct English first turns, each conversation split in two parts as ShareGPT V3 does."""
    out = []
    for i in range(n):
        text = f"Please {WORDS[i % 10]} something about item number {i} for me, and explain why."
        out += [conv(f"c{i:04d}_0", text), conv(f"c{i:04d}_1", f"And what is the next step for item {i}?")]
    return out


def topics_of(p) -> set[str]:
    return set(p.topic.split(" / ")) if p.prompt.startswith("What is the difference") else {p.topic}


def test_reader_keeps_every_complete_conversation_of_a_truncated_file():
    convs = chat_corpus(3)
    text = json.dumps(convs, indent=2)
    whole = med.read_sharegpt(text)
    assert whole.conversations == convs and not whole.truncated
    cut = text[: text.index('"c0002_0"') + 40]  # inside the fifth record
    part = med.read_sharegpt(cut)
    assert part.truncated and part.conversations == convs[:4]
    assert med.read_sharegpt(text[:-1]).conversations == convs  # only the closing bracket missing
    assert med.read_sharegpt("[]").conversations == []


def test_heldout_split_is_by_conversation_and_disjoint():
    convs = chat_corpus(1000)
    train, held, stats = med.sharegpt_prompts(convs, med.Filters(), seed=0)
    assert stats["first_turns"] == 1000  # later parts (_1) open mid-dialogue and are not first turns
    assert 5 <= len(held) <= 50 and len(train) + len(held) == 1000
    assert not {p.topic for p in train} & {p.topic for p in held}
    assert all(med.is_heldout(f"{p.topic}_1") for p in held)  # every part of a conversation on one side
    # Assignment depends only on the id: a different seed or filter never moves a conversation across.
    train2, held2, _ = med.sharegpt_prompts(convs[:600], med.Filters(max_chars=80), seed=1)
    assert {p.topic for p in held2} <= {p.topic for p in held}
    assert {p.topic for p in train2} <= {p.topic for p in train}
    # Seeded order; a smaller request is a prefix of a larger one (mixing keeps that too).
    assert [p.id for p in med.sharegpt_prompts(convs, med.Filters(), seed=0)[0]] == [p.id for p in train]
    old = [med.Prompt(f"o{i}", "train", "t", "q") for i in range(50)]
    big, small = med.mix(train[:300], old, 0.15), med.mix(train[:100], old[:18], 0.15)
    assert [p.id for p in small] == [p.id for p in big[: len(small)]]
    assert 0.12 < sum(p.id.startswith("o") for p in big[:200]) / 200 < 0.18


def test_filters_and_dedup():
    convs = [
        conv("a_0", "How do I bake bread at home?"),
        conv("b_0", "how do I bake BREAD at home ??"),  # same after normalization
        conv("c_0", "ok"),  # too short
        conv("d_0", "Wie backe ich Brot zu Hause? Bitte erklären Sie es mir."),  # not English
        conv("e_0", "Can you write a " + "very " * 200 + "long story?"),  # too long
        conv("f_0", "Hello there, are you a bot?", first="gpt"),  # does not open with the user
        conv("g_0", EVERYDAY_PROMPTS[0].upper()),  # a hand-written benchmark prompt
    ]
    exclude = {med.normalize(q) for q in EVERYDAY_PROMPTS}
    train, held, stats = med.sharegpt_prompts(convs, med.Filters(), seed=0, exclude=exclude)
    assert [p.prompt for p in train + held] == ["How do I bake bread at home?"]
    assert stats == {"records": 7, "first_turns": 6, "length_ok": 4, "english": 3, "unique": 1,
                     "train_pool": len(train), "heldout_pool": len(held)}  # fmt: skip


def dialog(cid: str, *users: str) -> dict:
    turns = []
    for u in users:
        turns += [{"from": "human", "value": u}, {"from": "gpt", "value": "Here you are."}]
    return {"id": cid, "conversations": turns}


def test_follow_up_turns_alternate_pass_the_filters_and_order_stays_the_pool_order():
    ok = med.Filters().passes
    c = dialog("x_0", "How do I bake bread at home?", "And how long should it rise?", "ok",
               "What about rye flour instead?")  # fmt: skip
    # "ok" fails the filters, and what follows it answers it: the list ends there
    assert med.later_user_turns(c, ok, 5) == ["And how long should it rise?"]
    assert med.later_user_turns(c, ok, 0) == []
    two_users = {"id": "y_0", "conversations": [
        {"from": "human", "value": "How do I bake bread at home?"}, {"from": "gpt", "value": "Like this."},
        {"from": "human", "value": "Which oven setting is best?"},
        {"from": "human", "value": "And which flour should I buy?"}]}  # fmt: skip
    assert med.later_user_turns(two_users, ok, 5) == ["Which oven setting is best?"]
    convs = chat_corpus(400) + [
        dialog(f"m{i:03d}_0", f"Please plan a trip number {i} for me.", f"Can you add a day {i} in Rome?",
               f"What should I pack for trip {i}?")
        for i in range(100)
    ]  # fmt: skip
    plain, held, _ = med.sharegpt_prompts(convs, med.Filters(), seed=0)
    assert all(p.follow_ups == [] for p in plain + held)  # one turn unless asked
    train, held3, stats = med.sharegpt_prompts(convs, med.Filters(turns=3, require_turns=2), seed=0)
    assert held3 == held and all(p.follow_ups == [] for p in held3)  # held-out stays first turns
    assert [p.id for p in train] == [p.id for p in plain if p.id.startswith("sg-m")]  # pool order kept
    assert stats["train_pool_with_turns"] == len(train) and all(len(p.follow_ups) == 2 for p in train)
    two = med.sharegpt_prompts(convs, med.Filters(turns=2, require_turns=2), seed=0)[0]
    assert [p.follow_ups for p in two] == [p.follow_ups[:1] for p in train]


def test_handwritten_set_is_large_varied_and_distinct():
    assert len(EVERYDAY_PROMPTS) >= 30
    assert len({med.normalize(q) for q in EVERYDAY_PROMPTS}) == len(EVERYDAY_PROMPTS)


def test_template_topics_are_disjoint_and_prompts_deterministic():
    prompts = med.build_prompts(400, 64, heldout_frac=0.1, seed=0)
    train = set().union(*(topics_of(p) for p in prompts if p.split == "train"))
    held = set().union(*(topics_of(p) for p in prompts if p.split == "heldout"))
    assert len(held) > 10 and not train & held
    assert len({p.id for p in prompts}) == len(prompts) == 464
    small = med.build_prompts(3, 2, heldout_frac=0.1, seed=0)
    assert [p.prompt for p in small if p.split == "train"] == [p.prompt for p in prompts[:3]]
    # Without ShareGPT the plan is the template recipe alone, in its own order.
    args = med.parse_args(
        ["--sharegpt", "none", "--num-train", "0", "--num-heldout", "0", "--num-old-train", "400"]
    )
    files, _ = med.plan(args, None)
    assert [p.prompt for p in files["train"]] == [p.prompt for p in prompts if p.split == "train"]
    assert files["heldout"] == [] and [p.prompt for p in files["heldout_old"]] == med.heldout_questions(64)


def test_done_outputs_drops_a_line_cut_by_a_kill(tmp_path):
    path = tmp_path / "train.jsonl"
    good = "".join(json.dumps({"id": f"r{i}", "output_ids": [i]}) + "\n" for i in range(3))
    path.write_text(good + '{"id": "r3", "outp')
    assert med.done_outputs(str(path)) == {"r0": [0], "r1": [1], "r2": [2]}
    assert path.read_text() == good  # the cut record will be generated again, not left as a broken line


def test_generator_never_speculates_with_the_default_model():
    """The Engine applies the default-model speculation to args with no algorithm; the generator's must opt out."""
    args = med.generator_args(None, "bfloat16")
    apply_default_server_speculation(args)
    assert not args.speculation
    bare = ServerArgs(log_level="warning")
    apply_default_server_speculation(bare)
    assert bare.speculation  # without the override the data would come from a speculative run


def test_responses_are_plain_greedy_and_reruns_resume(tmp_path):
    sharegpt = tmp_path / "sg.json"
    corpus = chat_corpus(300)
    cut = json.dumps(corpus)[:-300]  # truncated, as the packaged file is
    sharegpt.write_text(cut)
    complete = max(i for i in range(len(corpus)) if len(json.dumps(corpus[:i])) - 1 <= len(cut))
    out = tmp_path / "data"
    argv = ["--out", str(out), "--sharegpt", str(sharegpt), "--num-train", "2", "--num-heldout", "1",
            "--num-old-train", "1", "--num-heldout-old", "1", "--max-new-tokens", "6", "--dtype", "float32",
            "--batch-size", "2"]  # fmt: skip
    manifest = med.main(argv)
    files = manifest["files"]
    assert files["train"]["sources"] == {"sharegpt": 2, "pydoc": 1}
    assert files["heldout"]["prompts"] == 1 and files["heldout_old"]["prompts"] == 1
    assert manifest["sources"]["sharegpt"]["file_truncated"] and manifest["complete"]
    assert manifest["sources"]["sharegpt"]["complete_conversations"] == complete
    assert manifest["decoding"].startswith("plain greedy")
    med.main(argv)  # resumes: nothing is generated twice
    # A plan written where the data set is (--plan-only) generates the same records elsewhere (--plan).
    med.main(["--out", str(tmp_path / "plan"), "--plan-only", *argv[2:]])
    planned = med.main(["--out", str(tmp_path / "from-plan"), "--plan", str(tmp_path / "plan" / "plan.json"),
                        "--max-new-tokens", "6", "--dtype", "float32", "--batch-size", "2"])  # fmt: skip
    assert planned["sources"] == manifest["sources"] and planned["planned"] == manifest["planned"]
    for s in ("train", "heldout", "heldout_old"):
        assert (tmp_path / "from-plan" / f"{s}.jsonl").read_text() == (out / f"{s}.jsonl").read_text()
    recs = [
        json.loads(line) for s in ("train", "heldout", "heldout_old") for line in open(out / f"{s}.jsonl")
    ]
    assert len(recs) == len({r["id"] for r in recs}) == 5
    held_conv = {r["topic"] for r in recs if r["source"] == "sharegpt" and r["split"] == "heldout"}
    assert held_conv and not held_conv & {r["topic"] for r in recs if r["split"] == "train"}
    plain = ServerArgs(dtype="float32", speculative_algorithm="NONE", log_level="warning")
    with Engine(plain) as engine:
        for r in recs:
            got = engine.generate(
                input_ids=r["input_ids"], sampling_params={"temperature": 0, "max_new_tokens": 6}
            )
            assert got["output_ids"] == r["output_ids"]
        engine.wait_idle()
        mem = engine.memory_report()
        assert mem["used_pages"] == 0 and mem["used_rows"] == 0


def test_follow_up_turns_answer_with_the_targets_own_replies_and_resume(tmp_path):
    """A later turn's prompt is the dialogue so far with the target's own earlier answers; a run killed
    between turns answers only what is missing, and every answer is the target's plain greedy continuation."""
    from treepage.managers.tokenizer import apply_chat_template

    sharegpt = tmp_path / "sg.json"
    users = ("Please plan a trip number {} for me.", "Can you add a day {} in Rome?", "What to pack for {}?")
    convs = [dialog(f"m{i:03d}_0", *(u.format(i) for u in users)) for i in range(60)]
    sharegpt.write_text(json.dumps(convs))
    out = tmp_path / "data"
    argv = ["--out", str(out), "--sharegpt", str(sharegpt), "--num-train", "3", "--num-heldout", "0",
            "--num-old-train", "1", "--num-heldout-old", "0", "--turns", "3", "--require-turns", "2",
            "--max-new-tokens", "5", "--dtype", "float32", "--batch-size", "2"]  # fmt: skip
    manifest = med.main(argv)
    assert manifest["files"]["train"]["sources"] == {"sharegpt": 3, "sharegpt-turn2": 3, "sharegpt-turn3": 3,
                                                     "pydoc": 1}  # fmt: skip
    assert manifest["planned_records"]["train"] == 10 and manifest["complete"]
    path = out / "train.jsonl"
    whole = path.read_text()
    recs = {r["id"]: r for r in map(json.loads, whole.splitlines())}
    # Killed after the first turns of every conversation: the rerun answers the later turns again, the same.
    path.write_text("".join(line + "\n" for line in whole.splitlines() if json.loads(line)["turn"] == 1))
    med.main(argv)
    assert sorted(path.read_text().splitlines()) == sorted(whole.splitlines())  # no record twice
    plain = ServerArgs(dtype="float32", speculative_algorithm="NONE", log_level="warning")
    with Engine(plain) as engine:
        tok = engine.tokenizer
        for r in recs.values():
            if r["source"] == "pydoc":
                continue
            conv_id = r["id"].split("-t")[0]
            turns = [recs[conv_id if t == 1 else f"{conv_id}-t{t}"] for t in range(1, r["turn"])]
            messages = []
            for t in turns:
                reply = tok.decode(t["output_ids"], skip_special_tokens=True)
                messages.append({"role": "user", "content": t["prompt"]})
                messages.append({"role": "assistant", "content": reply})
            messages.append({"role": "user", "content": r["prompt"]})
            assert r["input_ids"] == apply_chat_template(tok, messages)
            sp = {"temperature": 0, "max_new_tokens": 5}
            got = engine.generate(input_ids=r["input_ids"], sampling_params=sp)
            assert got["output_ids"] == r["output_ids"]


def test_self_written_prompts_are_the_targets_own_seeded_new_and_resume(tmp_path):
    """The target writes training requests itself: each kept one is what it samples after the chat
    template's opening of a user turn with that candidate's seed, closed its turn, passes the filters and is
    new; a larger count extends the list (a prefix), and a candidate file cut by a kill is resampled the
    same."""
    out = tmp_path / "data"

    def argv(n_self: int) -> list[str]:
        return ["--out", str(out), "--sharegpt", "none", "--num-train", "0", "--num-heldout", "0",
                "--num-old-train", "2", "--num-heldout-old", "0", "--num-self-train", str(n_self),
                "--self-frac", "0.5", "--max-new-tokens", "4", "--dtype", "float32",
                "--batch-size", "2"]  # fmt: skip

    manifest = med.main(argv(3))
    assert manifest["files"]["train"]["sources"] == {"self": 3, "pydoc": 2}
    assert manifest["self_prompted"]["new"] == 3 and manifest["complete"]
    cand_path = out / "self_prompts.jsonl"
    cands = [json.loads(line) for line in cand_path.read_text().splitlines()]
    assert [c["seed"] for c in cands] == list(range(len(cands))) and len(cands) % 8 == 0  # chunks of 4 x 2
    recs = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    self_recs = [r for r in recs if r["source"] == "self"]
    expected, seen = [], {med.normalize(q) for q in EVERYDAY_PROMPTS}
    for c in cands:  # the funnel: what is left out was cut, filtered or a duplicate
        if c["ended"] and med.Filters().passes(c["text"]) and med.normalize(c["text"]) not in seen:
            seen.add(med.normalize(c["text"]))
            expected.append((f"self-{c['seed']}", c["text"]))
    assert [(r["id"], r["prompt"]) for r in self_recs] == expected[:3]
    with Engine(ServerArgs(dtype="float32", speculative_algorithm="NONE", log_level="warning")) as engine:
        opening = med.user_turn_opening(engine.tokenizer)
        assert engine.tokenizer.decode(opening).endswith("<|im_start|>user\n")
        params = [med.SELF_PROMPT_SAMPLING | {"seed": c["seed"]} for c in cands[:8]]
        again = engine.generate(input_ids=[opening] * 8, sampling_params=params)
        assert [(o["text"].strip(), o["meta_info"]["finish_reason"]["type"] == "stop") for o in again] == [
            (c["text"], c["ended"]) for c in cands[:8]
        ]
        for r in self_recs:  # answered as every record is: the target's plain greedy tokens
            sp = {"temperature": 0, "max_new_tokens": 4}
            got = engine.generate(input_ids=r["input_ids"], sampling_params=sp)
            assert got["output_ids"] == r["output_ids"]
    # Killed mid-line while sampling more: a rerun that needs the cut candidate resamples it the same, and the
    # larger count extends the list.
    whole = cand_path.read_text()
    cand_path.write_text(whole[: len(whole) - 20])
    more = len(expected) + 1  # one beyond what the candidates written hold
    bigger = med.main(argv(more))
    assert cand_path.read_text().startswith(whole)
    ids = [json.loads(line)["id"] for line in (out / "train.jsonl").read_text().splitlines()]
    assert ids[: len(recs)] == [r["id"] for r in recs] and len(ids) == len(recs) + more - 3
    assert bigger["files"]["train"]["sources"] == {"self": more, "pydoc": 2}
