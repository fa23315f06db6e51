"""Parallel sampling (n = 4) against 4 independent seeded requests, speculation off and on, side by side in one run.

    python benchmark/bench_parallel_sampling.py [--lengths 200 1000 2000] [--n 4] [--max-new 32] [--rounds 1]

What n > 1 saves (docs/design.md, "Parallel sampling"): one sample prefills the prompt, the others share its
whole pages and copy its partial last page, prefilling only their last prompt token. Default model
(SmolLM2-135M), fp32, page 64, temperature 0.7. Per speculation mode (off; EAGLE-3 with the shipped head and
the default server tree, fixed so that every engine drafts the same shape), three engines, their runs
interleaved (each prompt runs on every engine before the next, in a rotating order):
  - group: one request with n = --n and seed s;
  - independent, prefix cache off: --n requests with n = 1 and seeds s + i, submitted together (each one
    prefills the whole prompt);
  - independent, prefix cache on: the same. Requests submitted together race: one admitted in the same step
    as another finds none of its pages in the tree; a prompt over the chunk size (512 on CPU) is admitted
    alone, and the next one shares what the tree holds by then.
Prompts are --lengths tokens: the prose the other benchmarks use (common.passage_ids), each starting at its own
offset, so no prompt shares a page with another prompt or the warm-up, then an open question (TAIL). Reported
per run: the time to the first token of every sample (and of the first), the wall time to the last token, the
positions prefilled (the scheduler's counters: admitted - cached), and whether the group's samples equal the
seeded singles token for token. Results: benchmark/results/<--name>.json and markdown tables.
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402
    chat_ids,
    ensure_passive_omp,
    machine_info,
    machine_line,
    passage_ids,
    print_table,
    write_results,
)

from treepage.arg_groups import cpu_features  # noqa: E402
from treepage.arg_groups.speculative import DEFAULT_SERVER_PAGE, DEFAULT_SERVER_TREE  # noqa: E402
from treepage.core import Req  # noqa: E402
from treepage.entrypoints.engine import CumulativeOutput, Engine  # noqa: E402

TAIL = "\n\nIn your own words, what did the printing press change, and for whom?"
MODES = ("group", "independent, cache off", "independent, cache on")


class ModeRun:
    """One engine and one way of asking it for n samples of a prompt."""

    def __init__(self, mode: str, spec: bool, args: argparse.Namespace) -> None:
        self.mode, self.spec, self.args = mode, spec, args
        kw: dict = {"speculative_algorithm": "NONE"}
        if spec:
            S, K, N = DEFAULT_SERVER_TREE
            kw = {
                "speculative_num_steps": S,
                "speculative_eagle_topk": K,
                "speculative_num_draft_tokens": N,
                "speculative_adaptive": False,
            }
        self.eng = Engine(
            page_size=args.page,
            dtype="float32",
            disable_radix_cache=mode == "independent, cache off",
            max_total_tokens=args.max_total_tokens,
            log_level="warning",
            **kw,
        )
        self.runs: list[dict] = []

    def params(self, seed: int) -> dict:
        return {"temperature": self.args.temperature, "max_new_tokens": self.args.max_new, "ignore_eos": True, "seed": seed}

    def warm_up(self) -> None:
        ids = chat_ids(self.eng.tokenizer, "Why is the sky blue?")
        self.sample(ids, seed=7, new=4)

    def sample(self, ids: list[int], seed: int, new: int | None = None) -> dict:
        """n samples of `ids` (this engine's way); times, prefilled positions and the samples' output ids."""
        eng, n = self.eng, self.args.n
        p = self.params(seed)
        if new is not None:
            p["max_new_tokens"] = new
        eng.wait_idle()
        st = eng.scheduler.stats
        hit0, query0 = st.cache_hit_tokens, st.cache_query_tokens
        sinks: list[queue.Queue] = [queue.Queue() for _ in range(n)]
        t_submit = time.monotonic()
        reqs: list[Req]
        if self.mode == "group":
            reqs = eng.submit_samples(list(ids), eng.make_sampling_params(p), [q.put for q in sinks])
        else:
            reqs = [
                eng.submit(list(ids), eng.make_sampling_params({**p, "seed": seed + i}), q.put)
                for i, q in enumerate(sinks)
            ]
        outs = []
        for q in sinks:
            acc = CumulativeOutput()
            while not acc.finished:
                acc.add(q.get())
            outs.append(acc.output_ids)
        wall = time.monotonic() - t_submit
        eng.wait_idle()
        firsts = [r.first_token_time for r in reqs]
        assert all(t is not None for t in firsts)
        first = [t - t_submit for t in firsts if t is not None]
        query, hit = st.cache_query_tokens - query0, st.cache_hit_tokens - hit0
        return {
            "prompt_tokens": len(ids),
            "seed": seed,
            "ttft_all_s": max(first),
            "ttft_first_s": min(first),
            "wall_s": wall,
            "admitted_tokens": query,
            "cached_tokens": hit,
            "prefilled_tokens": query - hit,
            "output_ids": outs,
        }

    def close(self) -> dict:
        self.eng.wait_idle()
        mem = self.eng.memory_report()
        out = {
            "mode": self.mode,
            "spec": self.spec,
            "leaked": mem["used_pages"] != 0 or mem["used_rows"] != 0,
            "accept_length": self.eng.avg_spec_accept_length(),
            "runs": self.runs,
        }
        self.eng.shutdown()
        return out


def run_spec_mode(spec: bool, prompts: list[list[int]], seeds: list[int], args: argparse.Namespace) -> list[dict]:
    """Three engines for one speculation mode, their runs interleaved."""
    runs = [ModeRun(m, spec, args) for m in MODES]
    for r in runs:
        r.warm_up()
    for k, (ids, seed) in enumerate(zip(prompts, seeds)):
        for r in runs[k % len(runs) :] + runs[: k % len(runs)]:
            r.runs.append(r.sample(ids, seed))
            print(
                f"  spec={'EAGLE-3' if spec else 'off'} {r.mode}: {len(ids)} tokens, "
                f"TTFT(all) {r.runs[-1]['ttft_all_s']:.2f} s, wall {r.runs[-1]['wall_s']:.2f} s",
                flush=True,
            )
    return [r.close() for r in runs]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[200, 1000, 2000])
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=1, help="times every length is measured (fresh prompts)")
    ap.add_argument("--page", type=int, default=DEFAULT_SERVER_PAGE)
    ap.add_argument("--max-total-tokens", type=int, default=12288, help="KV pool per engine (three at once)")
    ap.add_argument("--spec", nargs="+", choices=["off", "eagle3"], default=["off", "eagle3"])
    ap.add_argument("--name", default="parallel_sampling_cpu")
    args = ap.parse_args(argv)
    ensure_passive_omp()
    info = machine_info()
    info["cpu_features"] = sorted(k for k, v in cpu_features().items() if v)

    probe = Engine(speculative_algorithm="NONE", page_size=args.page, max_total_tokens=1024, log_level="warning")
    tok = probe.tokenizer
    probe.shutdown()
    lengths = [L for _ in range(args.rounds) for L in args.lengths]
    # Offsets 1, 14, 27, ...: 13 is prime to the passage's period, so no two prompts start alike. The open
    # question at the end keeps the samples apart (after the repeated prose alone they all copy it alike).
    tail = tok.encode(TAIL, add_special_tokens=False)
    prompts = [passage_ids(tok, L - len(tail), offset=1 + 13 * k) + tail for k, L in enumerate(lengths)]
    seeds = [args.seed + 100 * k for k in range(len(lengths))]

    results: dict[str, list[dict]] = {}
    for spec_name in args.spec:
        print(f"speculation {spec_name}:", flush=True)
        results[spec_name] = run_spec_mode(spec_name == "eagle3", prompts, seeds, args)

    print(machine_line(info))
    checks: dict[str, bool] = {}
    for spec_name, engines in results.items():
        by_mode = {e["mode"]: e for e in engines}
        group = by_mode["group"]
        same = all(
            g["output_ids"] == by_mode[m]["runs"][k]["output_ids"]
            for m in MODES[1:]
            for k, g in enumerate(group["runs"])
        )
        distinct = all(len({tuple(o) for o in g["output_ids"]}) > 1 for g in group["runs"])
        checks[spec_name] = same
        rows = []
        for k, L in enumerate(lengths):
            g = group["runs"][k]
            for m in MODES:
                r = by_mode[m]["runs"][k]
                rows.append(
                    [
                        L,
                        m,
                        r["ttft_all_s"],
                        r["ttft_first_s"],
                        r["wall_s"],
                        r["ttft_all_s"] / g["ttft_all_s"],
                        r["wall_s"] / g["wall_s"],
                        r["prefilled_tokens"],
                        r["cached_tokens"],
                    ]
                )
        headers = [
            "prompt tokens",
            "how",
            "TTFT all samples s",
            "TTFT first s",
            "wall s",
            "TTFT / group",
            "wall / group",
            "positions prefilled",
            "positions cached",
        ]
        title = f"n = {args.n}, {args.max_new} new tokens, speculation {spec_name}, page {args.page}"
        print_table(title, headers, rows)
        print(f"speculation {spec_name}: group samples equal the seeded singles in both engines: {same}")
        print(f"speculation {spec_name}: every group has at least two distinct samples: {distinct}")
        print(f"speculation {spec_name}: leaks: {[e['leaked'] for e in engines]}")
    out = {
        "machine": info,
        "args": vars(args),
        "group_equals_seeded_singles": checks,
        "results": results,
    }
    print(write_results(args.name, out))
    return out


if __name__ == "__main__":
    main()
