"""JSON-schema constrained chat on the default model: tree speculation (the shipped EAGLE-3 head, the default
fixed tree) vs speculation off, and draft pruning on vs off, side by side and interleaved in one process.

    python benchmark/bench_grammar.py [--repeats 2] [--max-new-tokens 96]

Per configuration: output tokens/s (one request at a time, greedy), the mean accept length (tokens per
speculative round) and the grammar's share of the decode time (wall time inside the grammar processors, which
includes the draft-pruning masks, over the configuration's wall time; target <= 10 %). Results:
benchmark/results/<--name>.json and a markdown table (docs/benchmarks_grammar.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import chat_ids, ensure_passive_omp, machine_info, machine_line, print_table, write_results  # noqa: E402

from treepage.entrypoints.engine import Engine  # noqa: E402
from treepage.layers.grammar import TIMER  # noqa: E402
from treepage.models.loader import default_model_path  # noqa: E402
from treepage.models.shipped_heads import shipped_head_path  # noqa: E402
from treepage.server_args import ServerArgs  # noqa: E402
from treepage.speculative.eagle_worker import GRAMMAR_PRUNE_ENV  # noqa: E402

# (question, schema): realistic structured-extraction requests
REQUESTS = [
    ("Describe a fictional person: name, age and city.",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "city": {"type": "string"}}, "required": ["name", "age", "city"]}),
    ("Give a recipe for pancakes with a title, a list of ingredients and the minutes it takes.",
     {"type": "object", "properties": {"title": {"type": "string"},
                                       "ingredients": {"type": "array", "items": {"type": "string"}},
                                       "minutes": {"type": "integer"}}, "required": ["title", "ingredients", "minutes"]}),
    ("Classify the sentiment of: 'The film was long but the ending was wonderful.'",
     {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "mixed"]},
                                       "confidence": {"type": "number"}, "reason": {"type": "string"}},
      "required": ["sentiment", "confidence", "reason"]}),
    ("List three European capitals with their country.",
     {"type": "object", "properties": {"capitals": {"type": "array", "items": {
         "type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
         "required": ["city", "country"]}}}, "required": ["capitals"]}),
]  # fmt: skip


def _engine(spec: bool, prune: bool) -> Engine:
    os.environ[GRAMMAR_PRUNE_ENV] = "1" if prune else "0"  # read when the worker is built
    kw: dict = {"model_path": default_model_path()}  # an explicit path: no default-server speculation
    if spec:
        kw.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=shipped_head_path("EAGLE3"))
    return Engine(ServerArgs(**kw))


def _run(eng: Engine, prompts: list[list[int]], max_new: int) -> dict:
    """One request at a time; returns tokens, wall time, grammar time, speculative rounds and their tokens."""
    dbg0 = eng.worker.debug.to_dict() if hasattr(eng.worker, "debug") else None
    TIMER.reset()
    tokens, outs = 0, []
    t0 = time.perf_counter()
    for ids, (_, schema) in zip(prompts, REQUESTS):
        sp = {"temperature": 0, "max_new_tokens": max_new, "json_schema": json.dumps(schema)}
        out = eng.generate(input_ids=ids, sampling_params=sp)
        tokens += len(out["output_ids"])
        outs.append(out["output_ids"])
    wall = time.perf_counter() - t0
    res = {"tokens": tokens, "seconds": wall, "grammar_seconds": TIMER.seconds, "outputs": outs}
    if dbg0 is not None:
        dbg = eng.worker.debug.to_dict()
        res["rounds"] = dbg["rounds"] - dbg0["rounds"]
        res["emitted"] = dbg["emitted"] - dbg0["emitted"]
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--name", default="grammar_cpu")
    args = ap.parse_args(argv)
    ensure_passive_omp()
    configs = {"off": (False, False), "tree, pruned drafts": (True, True), "tree, unpruned drafts": (True, False)}
    engines = {name: _engine(*c) for name, c in configs.items()}
    try:
        first = next(iter(engines.values()))
        prompts = [chat_ids(first.tokenizer, q) for q, _ in REQUESTS]
        spec_eng = engines["tree, pruned drafts"]
        shape = spec_eng.worker.shape.label if hasattr(spec_eng.worker, "shape") else ""
        for eng in engines.values():  # warm-up (grammar compilation, first-call costs)
            _run(eng, prompts[:1], 8)
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(args.repeats):  # interleaved: a burst of contention hits every configuration
            for name, eng in engines.items():
                runs[name].append(_run(eng, prompts, args.max_new_tokens))
        dtype = str(first.dtype)
    finally:
        for eng in engines.values():
            eng.shutdown()
    rows, summary = [], {}
    off_tps = None
    for name, rs in runs.items():
        tok, sec = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
        tps = tok / sec
        off_tps = off_tps or tps
        rounds = sum(r.get("rounds", 0) for r in rs)
        accept = sum(r.get("emitted", 0) for r in rs) / rounds if rounds else 1.0
        share = sum(r["grammar_seconds"] for r in rs) / sec
        same = all(a["outputs"] == b["outputs"] for a, b in zip(rs, runs["off"]))
        summary[name] = {"tokens_per_s": tps, "speedup_vs_off": tps / off_tps, "accept_len": accept,
                         "grammar_share": share, "same_tokens_as_off": same}  # fmt: skip
        rows.append([name, f"{tps:.1f}", f"{tps / off_tps:.2f}x", f"{accept:.2f}", f"{100 * share:.1f} %", same])
    info = machine_info()
    print(machine_line(info))
    print_table(
        f"JSON-schema constrained chat, {len(REQUESTS)} requests x {args.repeats}, greedy, {dtype}, tree {shape}",
        ["config", "tokens/s", "vs off", "accept len", "grammar share", "same tokens as off"],
        rows,
    )
    for rs in runs.values():
        for r in rs:
            r.pop("outputs")
    out = {"machine": info, "args": vars(args), "dtype": dtype, "shape": shape, "summary": summary, "runs": runs}
    print("wrote", write_results(args.name, out))
    return out


if __name__ == "__main__":
    main()
