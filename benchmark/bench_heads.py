"""Shipped draft heads on held-out prompts: average accept length, tokens/s against speculation off, and greedy
equality of every speculative output with the plain one (same batch size, same page size).

    python benchmark/bench_heads.py                      # all configurations, batch 1 and 4
    python benchmark/bench_heads.py --configs EAGLE3:5,8,32 --num-prompts 2 --batch-sizes 1
    python benchmark/bench_heads.py --configs --profile  # only where the time goes (default tree vs plain)
    python benchmark/bench_heads.py --acceptance --head EAGLE3=build/eagle/head-eagle3  # three prompt sets

Held-out prompts are rebuilt by scripts/make_eagle_data.py's generator (topics never seen in training), so the
benchmark needs no data directory. --acceptance measures EAGLE-3 accept length on three sets the heads never
trained on: the ShareGPT held-out conversations, the template held-out prompts and the hand-written everyday
requests (benchmark/everyday_prompts.py), per tree shape, temperature and dtype, for the shipped head and every
--head; and, with --sets sharegpt_turns, on the later user turns of the held-out conversations, each sent as a
chat client sends it (the dialogue so far, every earlier reply the target's own). Results:
benchmark/results/<--name>.json plus a markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "scripts"))

from common import (  # noqa: E402
    DEFAULT_SET_SIZE,
    DIALOGUE_SET,
    PROMPT_SET_NAMES,
    chat_ids,
    ensure_passive_omp,
    machine_info,
    machine_line,
    parse_set_sizes,
    print_table,
    profile_decode,
    prompt_sets,
    run_requests,
    set_size,
    write_results,
)
from make_eagle_data import (  # noqa: E402
    Prompt,
    answer_turns,
    dialogue,
    heldout_questions,
    sharegpt_heldout_dialogues,
)

from treepage.arg_groups.speculative import DEFAULT_SERVER_TREE  # noqa: E402
from treepage.entrypoints.engine import CumulativeOutput, Engine  # noqa: E402
from treepage.managers.tokenizer import apply_chat_template, load_tokenizer  # noqa: E402
from treepage.models.loader import default_model_path  # noqa: E402
from treepage.models.shipped_heads import shipped_head_path  # noqa: E402
from treepage.server_args import ServerArgs  # noqa: E402

DEFAULT_CONFIGS = [
    "EAGLE3:5,8,32",
    "EAGLE3:5,4,16",
    "EAGLE3:4,4,16",
    "EAGLE3:5,1,6",
    "EAGLE3:3,1,4",
    "EAGLE:5,8,64",
]


def parse_config(text: str) -> tuple[str, int, int, int]:
    algo, _, tree = text.partition(":")
    S, K, N = (int(x) for x in tree.split(","))
    return algo.upper(), S, K, N


def head_digests(args) -> dict[str, str]:
    """sha256 of each head's weights, so a result names the exact head it measured."""
    out = {}
    for algo in ("EAGLE3", "EAGLE"):
        path = Path(args.head_dirs.get(algo) or shipped_head_path(algo)) / "model.safetensors"
        out[algo] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def measure(engine: Engine, prompts: list[list[int]], batch_size: int, max_new: int) -> dict:
    """Decode all prompts in groups of batch_size (each group submitted together)."""
    dbg = getattr(engine.worker, "debug", None)
    r0, e0 = (dbg.rounds, dbg.emitted) if dbg else (0, 0)
    outputs, seconds = [], 0.0
    for i in range(0, len(prompts), batch_size):
        run = run_requests(engine, prompts[i : i + batch_size], max_new, ignore_eos=False)
        outputs += [o["output_ids"] for o in run.outputs]
        seconds += run.seconds
    tokens = sum(len(o) for o in outputs)
    rounds = dbg.rounds - r0 if dbg else 0
    return {
        "batch_size": batch_size,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tok_per_s": round(tokens / seconds, 2),
        "accept_len": round((dbg.emitted - e0) / rounds, 3) if rounds else None,
        "outputs": outputs,
    }


def engine_args(args, spec: tuple[str, int, int, int] | None, **extra) -> ServerArgs:
    kw: dict = {"dtype": args.dtype, "page_size": args.page_size, "log_level": "warning"}
    if spec is None:
        kw["speculative_algorithm"] = "NONE"  # the default model would otherwise speculate with its head
    else:
        algo, S, K, N = spec
        kw.update(
            speculative_algorithm=algo,
            speculative_draft_model_path=args.head_dirs.get(algo) or shipped_head_path(algo),
            speculative_num_steps=S,
            speculative_eagle_topk=K,
            speculative_num_draft_tokens=N,
        )
    return ServerArgs(**kw, **extra)


def run_config(args, spec: tuple[str, int, int, int] | None, prompts: list[list[int]]) -> dict:
    engine = Engine(engine_args(args, spec))
    try:
        run_requests(engine, prompts[:1], 8, ignore_eos=False)  # warm-up, not timed
        return {str(bs): measure(engine, prompts, bs, args.max_new_tokens) for bs in args.batch_sizes}
    finally:
        engine.shutdown()


def profile(args, spec: tuple[str, int, int, int], prompts: list[list[int]]) -> dict:
    """Where the time of a decode step / speculative round goes, plain vs spec, at each batch size (spec v1: the
    same round as v2, stepped on this thread so that cProfile sees it)."""
    out: dict = {}
    for bs in args.batch_sizes:
        for label, sp in (("plain", None), ("spec", spec)):
            engine = Engine(engine_args(args, sp, disable_overlap_schedule=True))
            out[f"{label} b{bs}"] = profile_decode(engine, prompts[:bs], args.max_new_tokens)
    cols = list(out)
    labels = next(iter(out.values()))["labels"]
    rows = [[lb] + [out[c]["parts_ms_per_step"][lb.strip()] for c in cols] for lb in labels]
    rows += [
        ["ms per step / round (under the profiler)"] + [out[c]["ms_per_step"] for c in cols],
        ["tokens per step / round"] + [out[c]["tokens_per_step"] for c in cols],
        ["ms per token"] + [round(out[c]["ms_per_step"] / out[c]["tokens_per_step"], 2) for c in cols],
    ]
    algo, S, K, N = spec
    print_table(
        f"Where the time goes: {algo} (S, K, N) = ({S}, {K}, {N}) vs plain, page {args.page_size}, {args.dtype}, "
        f"ms per step (cumulative cProfile time; a speculative round is one step)",
        ["part"] + cols,
        rows,
    )
    return {"config": f"{algo}:{S},{K},{N}", "runs": out}


def decode_set(
    engine: Engine, prompts: list[list[int]], max_new: int, temperature: float, group: int
) -> dict:
    """All prompts, `group` submitted together, with one seed per prompt; accept length over the whole set."""
    dbg = engine.worker.debug if engine.args.speculation else None
    r0, e0 = (dbg.rounds, dbg.emitted) if dbg else (0, 0)
    outputs, per_prompt = [], []
    for g in range(0, len(prompts), group):
        sinks: list[queue.Queue] = []
        for i, ids in enumerate(prompts[g : g + group]):
            sp = engine.make_sampling_params(
                {"max_new_tokens": max_new, "temperature": temperature, "seed": g + i}
            )
            sinks.append(queue.Queue())
            engine.submit(list(ids), sp, sinks[-1].put)
        for q in sinks:  # the engine streams deltas; the ids are their concatenation
            acc = CumulativeOutput()
            while not acc.finished:
                acc.add(q.get())
            outputs.append(acc.output_ids)
            per_prompt.append(round(acc.meta_info.get("spec_accept_length", 0.0), 3))
    rounds = dbg.rounds - r0 if dbg else 0
    return {
        "accept_len": round((dbg.emitted - e0) / rounds, 3) if rounds else None,
        "accept_len_per_prompt": per_prompt if rounds else None,  # which requests the heads serve badly
        "outputs": outputs,
    }


def later_turn_prompts(
    engine: Engine, dialogs: list[Prompt], history_tokens: int, group: int
) -> list[list[int]]:
    """Every later user turn of `dialogs` as a chat client sends it: the dialogue so far, in which each earlier
    reply is this engine's greedy answer of up to history_tokens (answered as the training data's dialogues are,
    scripts/make_eagle_data.py). Conversation by conversation, turn by turn."""
    tok = engine.tokenizer
    answers: dict[str, list[int]] = {}

    def generate(ids: list[list[int]]) -> list[list[int]]:
        return decode_set(engine, ids, history_tokens, 0.0, group)["outputs"]

    # every turn but the last of each conversation is answered; the last ones are what the heads answer
    list(answer_turns(dialogs, answers, tok, generate, last=lambda p: len(p.follow_ups)))
    return [
        apply_chat_template(tok, dialogue(p, turn, answers, tok))
        for p in dialogs
        for turn in range(2, 2 + len(p.follow_ups))
    ]


def acceptance(args) -> dict:
    """Accept length of EAGLE-3 heads on every prompt set x tree shape x temperature x dtype (plus, greedy, plain
    decoding of the same prompts, so that fp32 exactness is checked on every set)."""
    machine = machine_info()
    tok = load_tokenizer(default_model_path())
    sizes = parse_set_sizes(args.set_size)
    sets: dict[str, list] = prompt_sets([s for s in args.sets if s != DIALOGUE_SET], sizes)
    ids = {name: [chat_ids(tok, q) for q in qs] for name, qs in sets.items()}
    dialogs = sharegpt_heldout_dialogues(set_size(sizes, DIALOGUE_SET)) if DIALOGUE_SET in args.sets else []
    if dialogs:  # the user turns of each conversation; the prompts depend on the dtype's answers
        sets[DIALOGUE_SET] = [[p.prompt, *p.follow_ups] for p in dialogs]
    heads = {} if args.skip_shipped else {"shipped": shipped_head_path("EAGLE3")}
    heads |= dict(h.split("=", 1) for h in args.compare)
    runs: list[dict] = []
    dialogue_tokens: dict[str, list[int]] = {}
    for dtype in args.dtypes:
        plain: dict[str, list] = {}
        if 0.0 in args.temperatures or dialogs:
            engine = Engine(ServerArgs(dtype=dtype, page_size=args.page_size, log_level="warning",
                                       speculative_algorithm="NONE"))  # fmt: skip
            try:
                if dialogs:
                    ids[DIALOGUE_SET] = later_turn_prompts(engine, dialogs, args.history_tokens, args.group)
                    dialogue_tokens[dtype] = [len(p) for p in ids[DIALOGUE_SET]]
                if 0.0 in args.temperatures:
                    for name, p in ids.items():
                        plain[name] = decode_set(engine, p, args.max_new_tokens, 0.0, args.group)["outputs"]
            finally:
                engine.shutdown()
        for label, path in heads.items():
            for shape in args.shapes:
                S, K, N = (int(x) for x in shape.split(","))
                engine = Engine(ServerArgs(
                    dtype=dtype, page_size=args.page_size, log_level="warning", speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=path, speculative_num_steps=S, speculative_eagle_topk=K,
                    speculative_num_draft_tokens=N,
                ))  # fmt: skip
                try:
                    for temp in args.temperatures:
                        for name, p in ids.items():
                            r = decode_set(engine, p, args.max_new_tokens, temp, args.group)
                            run = {
                                "head": label,
                                "dtype": dtype,
                                "shape": shape,
                                "temperature": temp,
                                "set": name,
                            }
                            run["accept_len"] = r["accept_len"]
                            run["accept_len_per_prompt"] = r["accept_len_per_prompt"]
                            if temp == 0.0:
                                run["equal_to_plain"] = sum(a == b for a, b in zip(r["outputs"], plain[name]))
                            print({k: v for k, v in run.items() if k != "accept_len_per_prompt"}, flush=True)
                            runs.append(run)
                            # a cut run keeps its numbers
                            partial = {"partial": True, "machine": machine, "args": vars(args), "runs": runs}
                            write_results(args.name, partial)
                finally:
                    engine.shutdown()
    rows = []
    for r in runs:
        eq = f"{r['equal_to_plain']}/{len(ids[r['set']])}" if "equal_to_plain" in r else "-"
        rows.append(
            [r["head"], r["dtype"], f"({r['shape']})", r["temperature"], r["set"], r["accept_len"], eq]
        )
    counts = ", ".join(f"{k} {len(v)}" for k, v in ids.items())
    print_table(
        f"EAGLE-3 accept length, prompts per set: {counts}; up to {args.max_new_tokens} new tokens, page {args.page_size}",
        ["head", "dtype", "(S,K,N)", "T", "set", "accept len", "equal to plain"],
        rows,
    )
    # Paths relative to the repository where they lie in it, so results name no machine's folders.
    where = {k: os.path.relpath(v, HERE.parent) if Path(v).resolve().is_relative_to(HERE.parent) else str(v)
             for k, v in heads.items()}  # fmt: skip
    return {"sets": sets, "dialogue_prompt_tokens": dialogue_tokens, "heads": where, "runs": runs}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS, help="ALGO:S,K,N (none: profile only)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head", action="append", default=[], help="ALGO=DIR: a head other than the shipped one")
    ap.add_argument("--name", default="heads_cpu", help="results file name (benchmark/results/NAME.json)")
    ap.add_argument("--profile", action="store_true", help="also profile plain vs --profile-config")
    ap.add_argument("--profile-config", default="EAGLE3:{},{},{}".format(*DEFAULT_SERVER_TREE))
    ap.add_argument("--acceptance", action="store_true", help="accept length on three prompt sets instead")
    ap.add_argument(
        "--compare", action="append", default=[], help="LABEL=DIR: another EAGLE-3 head to measure"
    )
    ap.add_argument("--skip-shipped", action="store_true", help="--acceptance: only the --compare heads")
    ap.add_argument(
        "--sets", nargs="+", choices=(*PROMPT_SET_NAMES, DIALOGUE_SET), default=["sharegpt", "old", "everyday"]
    )
    ap.add_argument(
        "--history-tokens", type=int, default=128,
        help=f"--sets {DIALOGUE_SET}: new tokens of each earlier reply (the training data's answers: 128)",
    )
    ap.add_argument(
        "--set-size", nargs="+", default=[str(DEFAULT_SET_SIZE)],
        help=f"--acceptance: prompts per set, or NAME=COUNT per set (COUNT 'all': the whole set; {DIALOGUE_SET}: "
        "conversations, each with one or two later turns)",
    )
    ap.add_argument("--shapes", nargs="+", default=["{},{},{}".format(*DEFAULT_SERVER_TREE), "5,8,32"])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--group", type=int, default=8, help="--acceptance: requests submitted together")
    args = ap.parse_args(argv)
    ensure_passive_omp()  # without it the main-thread profile runs 4-18x slow on a shared 2-core CPU
    args.head_dirs = dict(h.split("=", 1) for h in args.head)
    torch.set_num_threads(args.threads)

    if args.acceptance:
        results = {"machine": machine_info(), "args": vars(args), "acceptance": acceptance(args)}
        print(machine_line(results["machine"]))
        path = write_results(args.name, results)
        print(f"results: {os.path.relpath(path)}")
        return results
    questions = heldout_questions(args.num_prompts)
    prompts = [chat_ids(load_tokenizer(default_model_path()), q) for q in questions]
    results: dict = {"machine": machine_info(), "args": vars(args), "heads": head_digests(args)}
    results |= {"questions": questions, "runs": {}}
    plain: dict | None = None
    runs = [("plain", None)] + [(c, parse_config(c)) for c in args.configs] if args.configs else []
    for label, spec in runs:
        print(f"running {label} ...", flush=True)
        res = run_config(args, spec, prompts)
        if plain is None:
            plain = res
        for bs, r in res.items():
            r["equal_to_plain"] = r["outputs"] == plain[bs]["outputs"]
            # Where each output first leaves the plain one (its length when equal): bf16 near-ties show here.
            r["first_divergence"] = [
                next((i for i, (x, y) in enumerate(zip(o, p)) if x != y), min(len(o), len(p)))
                for o, p in zip(r["outputs"], plain[bs]["outputs"])
            ]
            r["speedup"] = round(r["tok_per_s"] / plain[bs]["tok_per_s"], 3)
        results["runs"][label] = res

    rows = []
    for label, res in results["runs"].items():
        for bs, r in res.items():
            rows.append(
                [label, bs, r["accept_len"] or "-", r["tok_per_s"], r["speedup"], r["equal_to_plain"]]
            )
    if args.profile:
        results["profile"] = profile(args, parse_config(args.profile_config), prompts)
    print(machine_line(results["machine"]))
    print_table(
        f"Shipped heads, {args.num_prompts} held-out prompts, greedy, {args.max_new_tokens} new tokens, "
        f"page {args.page_size}, {args.dtype}",
        ["config (S,K,N)", "batch", "accept len", "tok/s", "vs plain", "greedy equal"],
        rows,
    )
    for res in results["runs"].values():
        for r in res.values():
            r.pop("outputs")
    path = write_results(args.name, results)
    print(f"results: {os.path.relpath(path)}")
    return results


if __name__ == "__main__":
    main()
