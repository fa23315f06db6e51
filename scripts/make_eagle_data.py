"""Offline training data for the shipped draft heads: chat prompts built from CPython's help topics, answered
by the target itself (greedy, batched, through treepage's own engine).

Why self-generated: a draft head is scored on agreeing with the target, so the best labels are the target's
own greedy continuations (EAGLE-3 regenerates its data the same way). Why pydoc_data: it ships with every
CPython, so the data is reproducible without a hub or the network.

Output directory: train.jsonl and heldout.jsonl (one request per line: topic, prompt, input_ids, output_ids),
manifest.json (sizes, seeds, versions, wall time). Held-out prompts use topics never seen in training.
Re-running resumes: requests already in the jsonl files are skipped.

    python scripts/make_eagle_data.py --out build/eagle --num-train 1280 --num-heldout 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import sys
import time
from dataclasses import asdict, dataclass

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
    topic: str
    prompt: str


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


def build_prompts(num_train: int, num_heldout: int, heldout_frac: float, seed: int) -> list[Prompt]:
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
        if count > len(pool):
            raise ValueError(f"asked for {count} {split} prompts, only {len(pool)} distinct ones exist")
        out += [Prompt(f"{split}-{i:05d}", split, t, p) for i, (t, p) in enumerate(pool[:count])]
    return out


def heldout_questions(n: int) -> list[str]:
    """The first n held-out prompts of the default data set: topics the shipped heads never saw."""
    return [p.prompt for p in build_prompts(0, n, HELDOUT_FRAC, SEED)]


def done_ids(path: str) -> set[str]:
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {json.loads(line)["id"] for line in f if line.strip()}


def count_file(path: str) -> dict:
    prompts = tokens_in = tokens_out = 0
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            prompts += 1
            tokens_in += len(r["input_ids"])
            tokens_out += len(r["output_ids"])
    return {"prompts": prompts, "prompt_tokens": tokens_in, "response_tokens": tokens_out}


def generator_args(model_path: str | None, dtype: str):
    """Plain greedy decoding: with no flags the default model would speculate with the shipped head, and the data
    must not depend on the head it trains (in bf16 a speculative run can take the other token at near ties)."""
    from treepage.server_args import ServerArgs

    return ServerArgs(model_path=model_path, dtype=dtype, speculative_algorithm="NONE", log_level="warning")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="build/eagle")
    ap.add_argument("--model-path", default=None, help="target checkpoint (default: the embedded SmolLM2)")
    ap.add_argument("--num-train", type=int, default=1280)
    ap.add_argument("--num-heldout", type=int, default=64)
    ap.add_argument(
        "--heldout-frac", type=float, default=HELDOUT_FRAC, help="share of topics kept out of training"
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    from treepage.entrypoints.engine import Engine
    from treepage.managers.tokenizer import apply_chat_template

    os.makedirs(args.out, exist_ok=True)
    prompts = build_prompts(args.num_train, args.num_heldout, args.heldout_frac, args.seed)
    t0 = time.time()
    engine = Engine(generator_args(args.model_path, args.dtype))
    assert not engine.args.speculation
    try:
        for split in ("heldout", "train"):
            path = os.path.join(args.out, f"{split}.jsonl")
            skip = done_ids(path)
            todo = [p for p in prompts if p.split == split and p.id not in skip]
            bar = tqdm(total=len(todo), desc=f"generating {split}", unit="prompt")
            for i in range(0, len(todo), args.batch_size):
                chunk = todo[i : i + args.batch_size]
                ids = [
                    apply_chat_template(engine.tokenizer, [{"role": "user", "content": p.prompt}])
                    for p in chunk
                ]
                outs = engine.generate(
                    input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": args.max_new_tokens}
                )
                with open(path, "a") as f:
                    for p, inp, o in zip(chunk, ids, outs):
                        rec = asdict(p) | {"input_ids": inp, "output_ids": o["output_ids"]}
                        f.write(json.dumps(rec) + "\n")
                bar.update(len(chunk))
            bar.close()
    finally:
        engine.shutdown()
    manifest = {
        "source": "pydoc_data.topics (CPython help topics) + built-in chat subjects; responses = target greedy",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "model_path": engine.args.model_path,
        "dtype": args.dtype,
        "decoding": "plain greedy (speculation off)",
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "num_python_topics": len(python_topics()),
        "num_chat_topics": len(CHAT_TOPICS),
        "splits": {s: count_file(os.path.join(args.out, f"{s}.jsonl")) for s in ("train", "heldout")},
        "generation_wall_s_this_run": round(time.time() - t0, 1),
        "argv": sys.argv[1:] if argv is None else argv,
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    print(json.dumps(manifest["splits"], indent=2))
    return manifest


if __name__ == "__main__":
    main()
