"""Plain serving throughput: treepage vs transformers `generate`, same process, same weights, same dtype.

(a) batch 1, greedy, 128 new tokens from a chat prompt;
(b) 8 requests with mixed prompt lengths and mixed max_new_tokens. treepage batches them continuously; HF runs
    one left-padded `generate` with max_new_tokens = the batch maximum, and only each request's own
    max_new_tokens count as useful output (that is the work static batching wastes).
Both sides ignore EOS so every request produces exactly its budget. Each side is warmed up once, then the
timed runs alternate treepage / HF so background load on a shared machine hits both alike.

    python benchmark/bench_serving.py [--dtype bfloat16] [--repeats 3] [--new-tokens 128] [--profile]

Writes benchmark/results/serving_<device>.json. --profile adds torch.profiler and cProfile views of the
treepage batch-1 decode loop (driven on the main thread so both profilers see it).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import queue
import sys
import time

import torch
from common import (
    QUESTIONS,
    chat_ids,
    ensure_passive_omp,
    load_hf,
    machine_info,
    machine_line,
    median,
    passage_ids,
    print_table,
    run_requests,
    timed,
    write_results,
)

from treepage.entrypoints.engine import Engine
from treepage.models.loader import default_model_path
from treepage.server_args import ServerArgs

MIXED_PROMPT_LENS = [16, 400, 48, 256, 24, 128, 320, 64]
MIXED_MAX_TOKENS = [128, 16, 96, 32, 128, 24, 64, 16]


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new: int, pad_id: int) -> list[list[int]]:
    """One static batch: left padding, every row decodes max_new tokens (EOS does not stop it)."""
    width = max(len(p) for p in prompts)
    dev = model.device
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids.to(dev),
        attention_mask=mask.to(dev),
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return out[:, width:].tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def profile_decode(engine: Engine, prompt: list[int], new_tokens: int, top: int) -> dict:
    """Stop the scheduler thread and step it on this thread: torch.profiler and cProfile then see the decode."""
    engine.stop_scheduler()
    sched = engine.scheduler
    results = {}
    for kind in ("cprofile", "torch"):
        sink: queue.Queue = queue.Queue()
        sp = engine.make_sampling_params(
            {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
        )
        req = engine.submit(prompt, sp, sink.put)
        sched.step()  # prefill, outside the profile
        steps = 0
        t0 = time.perf_counter()
        if kind == "torch":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                while req.finished is None:
                    sched.step()
                    steps += 1
            wall = time.perf_counter() - t0
            avg = prof.key_averages()
            table = avg.table(sort_by="self_cpu_time_total", row_limit=top)
            print(f"\n### torch.profiler: treepage batch-1 decode, {steps} steps, {wall:.2f} s\n\n{table}")
            groups = _group_ops(prof.key_averages(group_by_input_shape=True), engine.vocab_size)
            results["torch_profiler"] = {"steps": steps, "wall_s": wall, "groups": groups}
            results["torch_profiler"]["top"] = [
                {"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
                for e in sorted(avg, key=lambda e: -e.self_cpu_time_total)[:top]
            ]
        else:
            pr = cProfile.Profile()
            pr.enable()
            while req.finished is None:
                sched.step()
                steps += 1
            pr.disable()
            wall = time.perf_counter() - t0
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
            print(f"\n### cProfile: treepage batch-1 decode, {steps} steps, {wall:.2f} s (by tottime)\n")
            print(s.getvalue())
            results["cprofile"] = {"steps": steps, "wall_s": wall}
    return results


_GROUPS = {
    "matmul: decoder linears": ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear"),
    "attention (SDPA or einsum/bmm, softmax, masks)": (
        "aten::scaled_dot_product_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_attention_math",
        "aten::bmm",
        "aten::einsum",
        "aten::logsumexp",
        "aten::exp",
        "aten::masked_fill",
        "aten::nan_to_num",
        "aten::sub",
        "aten::clamp_min",
    ),
    "KV gather / index / copy / casts": (
        "aten::index",
        "aten::index_put_",
        "aten::copy_",
        "aten::to",
        "aten::_to_copy",
    ),
}
LM_HEAD = "matmul: lm_head (vocab projection)"


def _group_ops(avg, vocab: int) -> dict[str, float]:
    """Self CPU ms by coarse group (avg grouped by input shape, so the lm_head matmul can be told apart)."""
    out = {LM_HEAD: 0.0, **{g: 0.0 for g in _GROUPS}, "other ops": 0.0}
    for e in avg:
        ms = e.self_cpu_time_total / 1e3
        if e.key in ("aten::mm", "aten::addmm") and any(vocab in (s or []) for s in e.input_shapes):
            out[LM_HEAD] += ms
            continue
        for g, names in _GROUPS.items():
            if e.key in names:
                out[g] += ms
                break
        else:
            out["other ops"] += ms
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-path", default=None, help="GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument(
        "--attention-backend", default=None, help="treepage backend (default: the engine's choice)"
    )
    ap.add_argument("--new-tokens", type=int, default=128, help="batch-1 output length")
    ap.add_argument(
        "--repeats", type=int, default=1, help="timed runs per side and scenario (median reported)"
    )
    ap.add_argument(
        "--mixed-scale", type=float, default=1.0, help="scale mixed max_tokens (quick runs: 0.25)"
    )
    ap.add_argument("--profile", action="store_true", help="profile the treepage batch-1 decode at the end")
    ap.add_argument("--profile-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="results name (default serving_<device>)")
    args = ap.parse_args(argv)
    ensure_passive_omp()
    dtype = getattr(torch, args.dtype)
    path = args.model_path or default_model_path()
    info = machine_info()
    print(machine_line(info), flush=True)

    t0 = time.perf_counter()
    engine = Engine(
        ServerArgs(
            model_path=path,
            dtype=args.dtype,
            device=args.device,
            attention_backend=args.attention_backend,
            log_level="warning",
        )
    )
    t_tp_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = load_hf(path, dtype, args.device)
    t_hf_load = time.perf_counter() - t0
    print(f"loaded: treepage {t_tp_load:.1f} s, transformers {t_hf_load:.1f} s", flush=True)
    tok = engine.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else engine.eos_ids[0]

    one = chat_ids(tok, QUESTIONS[1])
    mixed = [passage_ids(tok, n, offset=7 * i) for i, n in enumerate(MIXED_PROMPT_LENS)]
    mixed_mt = [max(1, round(m * args.mixed_scale)) for m in MIXED_MAX_TOKENS]
    n1 = args.new_tokens
    useful = sum(mixed_mt)
    hf_generated = len(mixed) * max(mixed_mt)

    def tp_run(prompts, max_tokens, want: int) -> tuple[list[list[int]], float]:
        run = run_requests(engine, prompts, max_tokens)
        assert run.output_tokens == want, f"treepage produced {run.output_tokens} tokens, wanted {want}"
        return [o["output_ids"] for o in run.outputs], run.seconds

    def hf_run(prompts, max_new: int) -> tuple[list[list[int]], float]:
        out, dt = timed(lambda: hf_generate(hf, prompts, max_new, pad_id))
        assert all(len(o) == max_new for o in out)
        return out, dt

    # Warm-up, once per side (short outputs: the shapes that matter are the decode steps and the prefills).
    tp_run([one], min(n1, 32), min(n1, 32))
    hf_run([one], min(n1, 32))
    tp_run(mixed, [min(m, 8) for m in mixed_mt], sum(min(m, 8) for m in mixed_mt))
    hf_run(mixed, 8)

    times: dict[str, list[float]] = {"tp_b1": [], "hf_b1": [], "tp_mixed": [], "hf_mixed": []}
    for r in range(args.repeats):  # alternate the sides so background load hits both alike
        tp_b1_ids, dt = tp_run([one], n1, n1)
        times["tp_b1"].append(dt)
        hf_b1_ids, dt = hf_run([one], n1)
        times["hf_b1"].append(dt)
        times["tp_mixed"].append(tp_run(mixed, mixed_mt, useful)[1])
        times["hf_mixed"].append(hf_run(mixed, max(mixed_mt))[1])
        print(
            f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
            flush=True,
        )
    # The mixed prompts with one output token each: how much of (b) is prefill.
    times["tp_mixed_prefill"] = [tp_run(mixed, 1, len(mixed))[1]]
    times["hf_mixed_prefill"] = [hf_run(mixed, 1)[1]]

    mem = engine.memory_report()
    tps = {
        "tp_b1": n1 / median(times["tp_b1"]),
        "hf_b1": n1 / median(times["hf_b1"]),
        "tp_mixed": useful / median(times["tp_mixed"]),
        "hf_mixed": useful / median(times["hf_mixed"]),
    }
    r1 = tps["tp_b1"] / tps["hf_b1"]
    rm = tps["tp_mixed"] / tps["hf_mixed"]
    agree = common_prefix(tp_b1_ids[0], hf_b1_ids[0])
    prompt_tokens = sum(MIXED_PROMPT_LENS)
    tp_pf, hf_pf = times["tp_mixed_prefill"][0], times["hf_mixed_prefill"][0]
    rows = [
        [
            f"(a) batch 1, {len(one)}-token chat prompt, {n1} new tokens",
            tps["tp_b1"],
            tps["hf_b1"],
            r1,
            ">= 1.0x",
            "met" if r1 >= 1.0 else "MISSED",
        ],
        [
            f"(b) mixed batch of {len(mixed)}: prompts {min(MIXED_PROMPT_LENS)}..{max(MIXED_PROMPT_LENS)}, "
            f"max_tokens {min(mixed_mt)}..{max(mixed_mt)} (useful {useful} of {hf_generated} HF tokens)",
            tps["tp_mixed"],
            tps["hf_mixed"],
            rm,
            ">= 2x",
            "met" if rm >= 2.0 else "MISSED",
        ],
    ]
    print_table(
        f"Output tokens/s, {args.dtype}, median of {args.repeats}",
        ["scenario", "treepage tok/s", "HF generate tok/s", "ratio", "target", "status"],
        rows,
    )
    print_table(
        "Mixed batch: time split (seconds, median)",
        ["side", "whole batch", "prefill only (1 token each)", "rest (decode)", "prompt tok/s in prefill"],
        [
            [
                "treepage",
                median(times["tp_mixed"]),
                tp_pf,
                median(times["tp_mixed"]) - tp_pf,
                prompt_tokens / tp_pf,
            ],
            [
                "HF generate",
                median(times["hf_mixed"]),
                hf_pf,
                median(times["hf_mixed"]) - hf_pf,
                prompt_tokens / hf_pf,
            ],
        ],
    )
    print(f"batch-1 greedy agreement treepage vs HF: first {agree} of {n1} tokens identical")
    print(f"treepage memory after the runs: {mem}")
    leak = mem["used_pages"] != 0 or mem["used_rows"] != 0
    if leak:
        print("WARNING: KV pages or rows still in use after all requests finished (leak)", file=sys.stderr)

    result = {
        "machine": info,
        "dtype": args.dtype,
        "model": os.path.basename(path),
        "attention_backend": engine.args.attention_backend,
        "load_s": {"treepage": t_tp_load, "transformers": t_hf_load},
        "batch1": {"prompt_tokens": len(one), "new_tokens": n1},
        "mixed": {
            "prompt_lens": MIXED_PROMPT_LENS,
            "max_tokens": mixed_mt,
            "useful_tokens": useful,
            "hf_generated_tokens": hf_generated,
        },
        "seconds": times,
        "tokens_per_s": tps,
        "ratio": {"batch1": r1, "mixed": rm},
        "batch1_greedy_common_prefix": agree,
        "memory_after": mem,
        "leak": leak,
        "loadavg_at_end": os.getloadavg(),
    }
    if args.profile:
        prof = profile_decode(engine, one, args.profile_tokens, top=20)
        result["profile"] = prof
        tp = prof["torch_profiler"]
        groups = tp["groups"]
        total = sum(groups.values())
        print_table(
            "Where the batch-1 decode time goes (torch.profiler self CPU time; the profiler inflates op time)",
            ["group", "ms", "share of op time", "ms per step"],
            [[g, ms, f"{ms / total:.0%}", ms / tp["steps"]] for g, ms in groups.items()]
            + [["wall time under torch.profiler", tp["wall_s"] * 1e3, "", tp["wall_s"] * 1e3 / tp["steps"]]],
        )
        cp = prof["cprofile"]
        print(
            f"cProfile wall: {cp['wall_s'] * 1e3 / cp['steps']:.1f} ms per decode step; unprofiled: "
            f"{median(times['tp_b1']) * 1e3 / n1:.1f} ms per token (incl. prefill)"
        )
    else:
        engine.shutdown()
    path_out = write_results(args.out or f"serving_{args.device}", result)
    print(f"wrote {path_out}")
    return 1 if leak else 0


if __name__ == "__main__":
    sys.exit(main())
