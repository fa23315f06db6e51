"""EAGLE-style tree speculation end to end: accept length, tokens/s and the cost of the holey layout.

For every (P, K, S, N) in the grid: one Engine, greedy decoding of a few chat prompts, compared with plain
decoding at the same page size in the same run (same prompts, same batching). Every speculative output must be
token-identical to the plain output (DESIGN §5); a mismatch is reported loudly and fails the run. The KV pool
must be empty after each config (no leaked pages or rows).

Target/draft pair: by default the embedded SmolLM2-135M-Instruct is the target and the draft is a STANDALONE
copy of it cut to its first --draft-layers decoder layers (+ final norm + tied lm_head), written as an HF
safetensors directory in a temp dir. Give --draft-path (and --algorithm EAGLE / EAGLE3, --model-path of the
matching target) to measure a trained head instead.

    python benchmark/bench_spec.py [--quick] [--batch 1] [--new-tokens 64] [--prompts 3] [--draft-layers 4]

Writes benchmark/results/spec_<device>[_quick].json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from common import (
    QUESTIONS,
    chat_ids,
    ensure_passive_omp,
    load_hf,
    machine_info,
    machine_line,
    print_table,
    profile_decode,
    run_requests,
    write_results,
)

from treepage.entrypoints.engine import Engine
from treepage.models.loader import default_model_path, load_config, load_state_dict, resolve_checkpoint
from treepage.server_args import ServerArgs


@dataclass(frozen=True)
class Tree:
    K: int
    S: int
    N: int


@dataclass
class Measured:
    P: int
    tree: Tree | None  # None: plain decoding
    seconds: float
    tokens: int
    outputs: list[list[int]]
    accept_len: float | None = None
    rounds: int = 0
    leak: dict = field(default_factory=dict)
    spec_version: int = 0

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds


# ---- target / draft checkpoints ----------------------------------------------------------------------------------
def write_hf_checkpoint(out_dir: str, hf_config: dict, state: dict[str, torch.Tensor], tokenizer=None) -> str:
    """config.json + model.safetensors (+ tokenizer files): a plain HF Llama directory treepage loads quickly."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def prepare_pair(args, tmp: str) -> tuple[str, str, str]:
    """(target_path, draft_path, algorithm). A GGUF target is re-written as HF safetensors (same float weights)
    so each of the many Engine starts loads in about a second instead of re-reading the GGUF and its tokenizer."""
    from treepage.managers.tokenizer import load_tokenizer

    target = args.model_path or default_model_path()
    kind, _ = resolve_checkpoint(target)
    state = None
    cfg = load_config(target)
    if kind == "gguf":
        state = load_state_dict(target)
        tok = load_tokenizer(target)
        hf_cfg = dict(cfg.hf_config, architectures=["LlamaForCausalLM"], torch_dtype="float32")
        target = write_hf_checkpoint(os.path.join(tmp, "target"), hf_cfg, state, tok)
    if args.draft_path:
        return target, args.draft_path, args.algorithm or "EAGLE3"
    n = args.draft_layers
    if not 1 <= n < cfg.num_hidden_layers:
        raise SystemExit(f"--draft-layers must be in 1..{cfg.num_hidden_layers - 1}")
    state = state if state is not None else load_state_dict(target)
    keep = {}
    for k, v in state.items():
        if k.startswith("model.layers."):
            if int(k.split(".")[2]) < n:
                keep[k] = v
        else:
            keep[k] = v
    draft_cfg = dict(
        cfg.hf_config, architectures=["LlamaForCausalLM"], num_hidden_layers=n, torch_dtype="float32"
    )
    draft = write_hf_checkpoint(os.path.join(tmp, f"draft_{n}layers"), draft_cfg, keep)
    return target, draft, args.algorithm or "STANDALONE"


# ---- the grid -------------------------------------------------------------------------------------------------
def tree_grid(
    topks: list[int], draft_tokens: list[int], steps: int, k1_max_steps: int
) -> tuple[list[Tree], list[str]]:
    """Valid (K, S, N); K == 1 forces N = S + 1 (a chain), with S capped; returns (trees, skipped reasons)."""
    from treepage.arg_groups.speculative import max_tree_candidates

    trees, skipped = [], []
    for K in topks:
        for N in draft_tokens:
            S = N - 1 if K == 1 else steps
            if K == 1 and S > k1_max_steps:
                skipped.append(f"K=1 N={N}: the chain would need S={S} > --k1-max-steps {k1_max_steps}")
                continue
            if N - 1 > max_tree_candidates(S, K):
                skipped.append(f"K={K} S={S} N={N}: N-1 > K + (S-1)K^2 = {max_tree_candidates(S, K)}")
                continue
            trees.append(Tree(K, S, N))
    return trees, skipped


def make_engine(args, target: str, draft: str, algorithm: str, P: int, tree: Tree | None) -> Engine:
    reserve_tokens = 4096 if tree is not None and P > 1 and tree.K > 1 else 1024
    total = max(16384, args.batch * (reserve_tokens + 512 + args.new_tokens))
    total = -(-total // P) * P
    sa = ServerArgs(
        model_path=target,
        dtype=args.dtype,
        device=args.device,
        page_size=P,
        attention_backend=args.attention_backend,
        context_length=args.context_length,
        max_total_tokens=total,
        max_running_requests=max(4, args.batch),
        log_level="warning",
        random_seed=0,
        disable_overlap_schedule=args.disable_overlap_schedule,
    )
    if tree is not None:
        sa.speculative_algorithm = algorithm
        sa.speculative_draft_model_path = draft
        sa.speculative_num_steps, sa.speculative_eagle_topk = tree.S, tree.K
        sa.speculative_num_draft_tokens = tree.N
        sa.speculative_debug_fixed_accept_len = args.fixed_accept_len and min(
            args.fixed_accept_len, tree.S + 1
        )
    return Engine(sa)


def measure(args, engine: Engine, prompts: list[list[int]], P: int, tree: Tree | None) -> Measured:
    """Warm up once, then decode every prompt (in groups of --batch submitted together)."""
    run_requests(engine, prompts[: args.batch], 6)
    engine.wait_idle()
    debug = getattr(engine.worker, "debug", None)
    before = debug.to_dict() if debug else None
    outputs: list[list[int]] = []
    seconds = 0.0
    for i in range(0, len(prompts), args.batch):
        run = run_requests(engine, prompts[i : i + args.batch], args.new_tokens)
        seconds += run.seconds
        outputs += [o["output_ids"] for o in run.outputs]
    engine.wait_idle()
    mem = engine.memory_report()
    m = Measured(
        P, tree, seconds, sum(len(o) for o in outputs), outputs, spec_version=engine.args.spec_version
    )
    if mem["used_pages"] or mem["used_rows"]:
        m.leak = mem
    if debug:
        after = debug.to_dict()
        m.rounds = after["rounds"] - before["rounds"]
        m.accept_len = (after["emitted"] - before["emitted"]) / max(m.rounds, 1)
    return m


def first_mismatch(a: list[list[int]], b: list[list[int]]) -> list[tuple[int, int]]:
    """[(prompt index, first differing position)] for every prompt whose outputs differ."""
    bad = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            pos = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            bad.append((i, pos))
    return bad


def profile_round(
    args, target: str, draft: str, algorithm: str, P: int, tree: Tree, prompt: list[int]
) -> dict:
    """cProfile of spec v1 rounds stepped on this thread (v2 would run them on its forward thread)."""
    engine = make_engine(
        argparse.Namespace(**{**vars(args), "disable_overlap_schedule": True}),
        target,
        draft,
        algorithm,
        P,
        tree,
    )
    prof = profile_decode(engine, [prompt], args.new_tokens)
    print_table(
        f"cProfile of spec v1 rounds, P={P} K={tree.K} S={tree.S} N={tree.N}: {prof['steps']} rounds, "
        f"{prof['ms_per_step']:.1f} ms per round under the profiler (cumulative time)",
        ["part", "ms per round", "calls per round"],
        [
            [lb, prof["parts_ms_per_step"][lb.strip()], prof["calls_per_step"][lb.strip()]]
            for lb in prof["labels"]
        ],
    )
    return {"P": P, "K": tree.K, "S": tree.S, "N": tree.N, **prof}


NEAR_TIE = 0.25  # fp32 logit gap under which a bf16 decode and a bf16 tree verify may legitimately disagree


@torch.inference_mode()
def diagnose(hf, prompt: list[int], plain_out: list[int], spec_out: list[int], pos: int) -> dict:
    """fp32 logits of the two disagreeing tokens after their common prefix: a near tie is bf16 rounding
    (decode and verify forwards round differently), a clear gap is a speculation bug."""
    logits = hf(torch.tensor([prompt + plain_out[:pos]])).logits[0, -1].float()
    a, b = plain_out[pos], spec_out[pos]
    gap = abs(float(logits[a] - logits[b]))

    def rank(t: int) -> int:
        return int((logits > logits[t]).sum())

    return {
        "position": pos,
        "plain_token": a,
        "spec_token": b,
        "fp32_rank_plain": rank(a),
        "fp32_rank_spec": rank(b),
        "fp32_logit_gap": gap,
        "near_tie": gap < NEAR_TIE and max(rank(a), rank(b)) <= 1,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few configs, short outputs (development)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention-backend", default="torch_native")
    ap.add_argument("--model-path", default=None, help="target (default: the embedded SmolLM2-135M GGUF)")
    ap.add_argument("--draft-path", default=None, help="a trained EAGLE / EAGLE-3 head or a standalone draft")
    ap.add_argument("--algorithm", default=None, choices=("EAGLE", "EAGLE3", "STANDALONE"))
    ap.add_argument("--draft-layers", type=int, default=4, help="layers kept in the built standalone draft")
    ap.add_argument("--batch", type=int, default=1, help="requests submitted together")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--context-length", type=int, default=2048)
    ap.add_argument("--page-sizes", default="1,64")
    ap.add_argument("--topks", default="1,4,8")
    ap.add_argument("--draft-tokens", default="8,16,32")
    ap.add_argument("--steps", type=int, default=5, help="S for K > 1")
    ap.add_argument("--k1-max-steps", type=int, default=7, help="K == 1 uses S = N - 1, skipped above this")
    ap.add_argument("--disable-overlap-schedule", action="store_true", help="spec v1 instead of v2")
    ap.add_argument(
        "--fixed-accept-len",
        type=int,
        default=None,
        help="debug: force every verify to accept this many tokens (capped at S+1); outputs are then NOT the "
        "target's, so the identity check is skipped",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile the rounds of the last config")
    ap.add_argument("--drift-check", action="store_true", help="run plain decoding again at the end")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    ensure_passive_omp()
    if args.quick:
        args.prompts, args.new_tokens = min(args.prompts, 2), min(args.new_tokens, 24)
        args.topks, args.draft_tokens = "1,4", "8"
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    trees, skipped = tree_grid(
        [int(x) for x in args.topks.split(",")],
        [int(x) for x in args.draft_tokens.split(",")],
        args.steps,
        args.k1_max_steps,
    )
    info = machine_info()
    print(machine_line(info), flush=True)
    for s in skipped:
        print(f"skipped: {s}")
    t_start = time.perf_counter()

    tmp_holder = tempfile.TemporaryDirectory(prefix="treepage_bench_spec_")
    target, draft, algorithm = prepare_pair(args, tmp_holder.name)
    draft_desc = (
        f"{args.draft_path} ({algorithm})"
        if args.draft_path
        else f"STANDALONE: the target cut to its first {args.draft_layers} of "
        f"{load_config(target).num_hidden_layers} decoder layers + final norm + tied lm_head"
    )
    print(f"target {target}\ndraft  {draft_desc}", flush=True)
    from treepage.managers.tokenizer import load_tokenizer

    tok = load_tokenizer(target)
    prompts = [chat_ids(tok, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.prompts)]

    plain: dict[int, list[Measured]] = {}
    spec: list[Measured] = []
    # Page sizes alternate inside each config, so machine-load drift hits the P ratio's two sides alike;
    # with --drift-check plain decoding runs first and last, to show the drift over the whole sweep.
    runs = [(None, "plain")] + [(t, "spec") for t in trees]
    if args.drift_check:
        runs.append((None, "plain again (drift)"))
    for tree, label in runs:
        for P in page_sizes:
            t0 = time.perf_counter()
            engine = make_engine(args, target, draft, algorithm, P, tree)
            load_s = time.perf_counter() - t0
            try:
                m = measure(args, engine, prompts, P, tree)
            finally:
                engine.shutdown()
                del engine
                gc.collect()
            (plain.setdefault(P, []) if tree is None else spec).append(m)
            desc = "plain" if tree is None else f"K={tree.K} S={tree.S} N={tree.N} v{m.spec_version}"
            acc = f", accept {m.accept_len:.2f} over {m.rounds} rounds" if m.accept_len is not None else ""
            print(
                f"P={P} {desc}: {m.tps:.1f} tok/s ({m.tokens} tokens in {m.seconds:.1f} s; load {load_s:.1f} s)"
                f"{acc}{'  LEAK ' + str(m.leak) if m.leak else ''}  [{label}, t+{time.perf_counter() - t_start:.0f}s]",
                flush=True,
            )

    # ---- checks and tables ----------------------------------------------------------------------------------
    problems: list[str] = []
    ref = plain[page_sizes[0]][0].outputs
    for P, ms in plain.items():
        for m in ms:
            bad = first_mismatch(m.outputs, ref)
            if bad:
                problems.append(f"plain P={P} differs from plain P={page_sizes[0]}: (prompt, position) {bad}")
    for m in spec + [x for ms in plain.values() for x in ms]:
        if m.leak:
            problems.append(f"leak after P={m.P} {m.tree}: {m.leak}")
    rows, identical, diagnoses = [], {}, []
    hf_fp32 = None
    for m in spec:
        base = plain[m.P]
        plain_tps = sum(x.tps for x in base) / len(base)
        if args.fixed_accept_len:
            same = "n/a (forced accept)"
        else:
            bad = first_mismatch(m.outputs, base[0].outputs)
            identical[(m.P, m.tree)] = not bad
            same = "yes"
            if bad:
                if hf_fp32 is None:
                    hf_fp32 = load_hf(target, torch.float32, "cpu")
                diag = [
                    dict(prompt=i, **diagnose(hf_fp32, prompts[i], base[0].outputs[i], m.outputs[i], pos))
                    for i, pos in bad
                ]
                diagnoses.append({"P": m.P, "K": m.tree.K, "S": m.tree.S, "N": m.tree.N, "mismatches": diag})
                ties = all(d["near_tie"] for d in diag)
                same = (
                    ("no, near tie" if ties else "NO")
                    + ": "
                    + ", ".join(f"p{d['prompt']}@{d['position']} gap {d['fp32_logit_gap']:.2f}" for d in diag)
                )
                problems.append(
                    f"{'near-tie ' if ties else ''}MISMATCH speculative vs plain at P={m.P} K={m.tree.K} "
                    f"S={m.tree.S} N={m.tree.N}: {diag}"
                )
        rows.append(
            [
                m.P,
                m.tree.K,
                m.tree.S,
                m.tree.N,
                f"v{m.spec_version}",
                m.accept_len,
                m.tps,
                plain_tps,
                m.tps / plain_tps,
                same,
            ]
        )
    print_table(
        f"Speculative decoding, {args.dtype}, batch {args.batch}, {len(prompts)} prompts x {args.new_tokens} tokens",
        ["P", "K", "S", "N", "spec", "accept len", "tok/s", "plain tok/s", "vs plain", "identical to plain"],
        rows,
    )
    by = {(m.P, m.tree): m for m in spec}
    ratio_rows = []
    if len(page_sizes) >= 2:
        p1, pb = page_sizes[0], page_sizes[-1]
        for t in trees:
            a, b = by.get((p1, t)), by.get((pb, t))
            if a and b:
                r = b.tps / a.tps
                ratio_rows.append([t.K, t.S, t.N, a.tps, b.tps, r, "met" if r >= 0.95 else "MISSED"])
        plain_r = (sum(x.tps for x in plain[pb]) / len(plain[pb])) / (
            sum(x.tps for x in plain[p1]) / len(plain[p1])
        )
        ratio_rows.append(["plain", "-", "-", "", "", plain_r, ""])
        print_table(
            f"Holey layout cost: P={pb} / P={p1} throughput at equal (K, S, N) (target >= 0.95)",
            ["K", "S", "N", f"P={p1} tok/s", f"P={pb} tok/s", "ratio", "target"],
            ratio_rows,
        )
    for s in skipped:
        print(f"skipped: {s}")
    profile = None
    if args.profile and trees:
        profile = profile_round(args, target, draft, algorithm, page_sizes[-1], trees[-1], prompts[0])
    wall = time.perf_counter() - t_start
    print(f"total wall {wall:.0f} s")
    if problems:
        print("\n" + "!" * 100, file=sys.stderr)
        for p in problems:
            print(f"PROBLEM: {p}", file=sys.stderr)
        print("!" * 100, file=sys.stderr)

    def record(m: Measured) -> dict:
        d = {
            "P": m.P,
            "seconds": m.seconds,
            "tokens": m.tokens,
            "tokens_per_s": m.tps,
            "leak": m.leak,
            "outputs": m.outputs,
        }
        if m.tree is not None:
            d |= {
                "K": m.tree.K,
                "S": m.tree.S,
                "N": m.tree.N,
                "spec_version": m.spec_version,
                "accept_len": m.accept_len,
                "rounds": m.rounds,
                "identical_to_plain": identical.get((m.P, m.tree)),
            }
        return d

    result = {
        "machine": info,
        "loadavg_at_end": os.getloadavg(),
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
        "batch": args.batch,
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "draft": draft_desc,
        "algorithm": algorithm,
        "fixed_accept_len": args.fixed_accept_len,
        "plain": {str(P): [record(m) for m in ms] for P, ms in plain.items()},
        "spec": [record(m) for m in spec],
        "p_ratio": [dict(zip(["K", "S", "N", "tps_p1", "tps_pbig", "ratio"], r[:6])) for r in ratio_rows],
        "skipped": skipped,
        "problems": problems,
        "mismatch_diagnoses": diagnoses,
        "profile": profile,
        "wall_s": wall,
    }
    name = args.out or f"spec_{args.device}{'_quick' if args.quick else ''}"
    print(f"wrote {write_results(name, result)}")
    tmp_holder.cleanup()
    hard = [p for p in problems if not p.startswith("near-tie")]
    return 1 if hard else 0


if __name__ == "__main__":
    sys.exit(main())
