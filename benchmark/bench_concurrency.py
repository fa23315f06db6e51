"""The default server (adaptive speculation) against speculation off and against every fixed candidate shape,
all real `launch_server` processes driven by the official openai client with streaming, side by side in one run,
at several concurrency levels.

    python benchmark/bench_concurrency.py [--concurrency 1 2 4 8] [--requests 2] [--reps 1] [--max-tokens 64]
        [--length-spread 0] [--prompts sharegpt|old|everyday] [--no-control]

Every server gets the same chat requests, none of which the shipped heads were trained on: ShareGPT first turns
from the held-out conversations (the default: real traffic), the template domain's held-out questions ("old";
runs 1-20 used these), or the hand-written everyday requests (common.prompt_sets, as bench_heads.py); `c` streams in
flight at a time, `max(--requests, c)` requests per level, greedy, exactly --max-tokens tokens each (ignore_eos).
With `--length-spread F` > 0 each request instead gets its own length, drawn once (seeded, the same for every
server and pass) uniformly from [(1 - F), (1 + F)] x --max-tokens, as in SGLang's bench_serving random lengths:
fixed lengths keep plain decoding's streams in step (they finish and are prefilled together), which real traffic
does not.
Each server serves a level `--reps` times, the order of the servers rotated by one on every pass (`pass_order`):
each server's passes lie about one round of the others apart, so a slow stretch of the host falls on different
servers. The order used to be reversed on every pass, which ran the two servers at its ends (the default and the
control) twice back to back at each turn, and a slow minute there cost them two passes
(docs/benchmarks_adaptive.md "Run 30"). Output tok/s = completion tokens / wall time, summed over a server's passes;
ITL = the gaps between streamed chunks of a request (a speculative round may deliver several tokens in one
chunk, as in SGLang's bench_serving). Results: benchmark/results/<--name>.json, a markdown table and a PNG.
Servers start one at a time, the default first; a second default server started last (`--control`, on by
default) measures what the start position alone costs: on one slow host the server started first ran ~20 % slower
per round (docs/benchmarks_adaptive.md "Run 27"); identical servers on a normal one showed no such effect ("Run 28").
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "test"))

import httpx  # noqa: E402
import openai  # noqa: E402
from common import (  # noqa: E402
    PROMPT_SET_NAMES,
    ensure_passive_omp,
    machine_info,
    machine_line,
    print_table,
    prompt_sets,
    write_results,
)

from server_utils import launch_server  # noqa: E402
from treepage.arg_groups.speculative import DEFAULT_SERVER_TREE  # noqa: E402
from treepage.speculative.adaptive import TreeShape, default_candidates  # noqa: E402

DOCS = HERE.parent / "docs"
DEFAULT = "default (adaptive)"
CONTROL = "default, started last"  # the same server as DEFAULT, started after every other one
# the adaptive servers, each with the key of its comparison with the best of the rest in a level's JSON entry
ADAPTIVE = {DEFAULT: "default_vs_best", CONTROL: "control_vs_best"}


def servers(control: bool = True) -> dict[str, list[str]]:
    """Name -> launch flags, in start order. Fixed shapes use the default server's model, head and pages with
    explicit flags (which turn adaptation off); "off" keeps the 64-token pages so only speculation differs; the
    control is the default server again, started last."""
    out: dict[str, list[str]] = {
        DEFAULT: [],
        "off": ["--speculative-algorithm", "NONE", "--page-size", "64"],
    }
    for c in default_candidates(TreeShape(*DEFAULT_SERVER_TREE)):
        out[f"fixed {c.label}"] = [
            "--speculative-num-steps", str(c.steps), "--speculative-eagle-topk", str(c.topk),
            "--speculative-num-draft-tokens", str(c.draft_tokens),
        ]  # fmt: skip
    if control:
        out[CONTROL] = []
    return out


def stream_one(client: openai.OpenAI, question: str, max_tokens: int) -> dict:
    """One streamed chat completion: completion tokens, and the arrival time of every content chunk."""
    t0 = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
    return {"tokens": tokens, "ttft": arrivals[0] - t0 if arrivals else None, "arrivals": arrivals}


def pass_order(names: list[str], index: int) -> list[str]:
    """The servers' order in the index-th pass of a run (counting over levels): rotated by one from the pass before,
    so no server serves two passes back to back and over len(names) passes each takes every position once."""
    k = index % len(names)
    return names[k:] + names[:k]


def length_range(max_tokens: int, spread: float) -> tuple[int, int]:
    """The output lengths --length-spread allows: [(1 - spread), (1 + spread)] x max_tokens, rounded."""
    if not 0 <= spread < 1:
        raise ValueError(f"--length-spread must be in [0, 1), got {spread}")
    return round(max_tokens * (1 - spread)), round(max_tokens * (1 + spread))


def output_lengths(n: int, max_tokens: int, spread: float, seed: int = 0) -> list[int]:
    """Each request's output length, uniform in length_range (all --max-tokens without a spread)."""
    lo, hi = length_range(max_tokens, spread)
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def lengths_line(max_tokens: int, spread: float) -> str:
    lo, hi = length_range(max_tokens, spread)
    return f"{max_tokens} tokens per request" if lo == hi else f"{lo}-{hi} tokens per request (uniform)"


def run_level(base_url: str, requests: list[tuple[str, int]], concurrency: int) -> dict:
    """One pass over the (question, output length) requests, `concurrency` streams in flight: raw tokens, seconds,
    ITL gaps and TTFTs."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=900, max_retries=0)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda r: stream_one(client, *r), requests))
    return {
        "requests": len(done),
        "tokens": sum(d["tokens"] for d in done),
        "seconds": time.perf_counter() - t0,
        "gaps": [b - a for d in done for a, b in zip(d["arrivals"], d["arrivals"][1:])],
        "ttfts": [d["ttft"] for d in done if d["ttft"] is not None],
    }


def summarize(passes: list[dict]) -> dict:
    """A server's passes at one level: tok/s over all of them (and per pass), medians over all ITLs and TTFTs."""
    tokens = sum(p["tokens"] for p in passes)
    seconds = sum(p["seconds"] for p in passes)
    gaps = [g for p in passes for g in p["gaps"]]
    ttfts = [t for p in passes for t in p["ttfts"]]
    return {
        "requests": sum(p["requests"] for p in passes),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 3),
        "tok_per_s_per_pass": [round(p["tokens"] / p["seconds"], 3) for p in passes],
        "median_itl_ms": round(statistics.median(gaps) * 1e3, 1) if gaps else None,
        "median_ttft_ms": round(statistics.median(ttfts) * 1e3, 1) if ttfts else None,
    }


# what the policy believed at the end of each pass: why it served the shapes it served
POLICY_STATE_KEYS = ("current", "one_draft_excess", "excess_ratio", "accept_estimate", "host_speed_factor")


def adaptive_state(base_url: str) -> dict:
    """The default server's policy snapshot (/get_server_info): rounds per shape so far, estimates."""
    info = httpx.get(f"{base_url}/get_server_info", timeout=10).json()
    return dict(info.get("speculative_adaptive") or {})


def policy_state(state: dict, concurrency: int) -> dict:
    """The estimates behind the choice at one level: POLICY_STATE_KEYS and the expected round seconds of each shape
    at the batch sizes this level runs (1 to its concurrency)."""
    out = {k: state.get(k) for k in POLICY_STATE_KEYS}
    served = state.get("served_seconds", {})
    out["served_seconds"] = {
        shape: {b: t for b, t in times.items() if int(b) <= concurrency} for shape, times in served.items()
    }
    return out


def versus_best(run: dict, name: str = DEFAULT) -> dict:
    """A default server's tok/s over the best server that is not a default one at one level: summed over the
    passes, and within each pass (how far apart those are is the machine's noise)."""
    others = [n for n in run if n not in ADAPTIVE and n not in ADAPTIVE.values()]  # servers, not comparisons
    best = max(others, key=lambda n: run[n]["tok_per_s"])
    per_pass = [
        d / max(run[n]["tok_per_s_per_pass"][i] for n in others)
        for i, d in enumerate(run[name]["tok_per_s_per_pass"])
    ]
    return {
        "best": best,
        "ratio": round(run[name]["tok_per_s"] / run[best]["tok_per_s"], 3),
        "ratio_per_pass": [round(r, 3) for r in per_pass],
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [int(c) for c in results["runs"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in results["servers"]:
        ys = [results["runs"][str(c)][name]["tok_per_s"] for c in levels]
        style: dict = {"linestyle": "--"}
        if name in ADAPTIVE:
            style = {"linewidth": 3, "color": "black" if name == DEFAULT else "grey"}
        ax.plot(levels, ys, marker="o", label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tok/s")
    args = results["args"]  # runs before --length-spread have no spread: fixed lengths
    lengths = lengths_line(args["max_tokens"], args.get("length_spread", 0.0))
    ax.set_title(f"Default (adaptive) vs off vs fixed shapes, one run\n{lengths}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--requests", type=int, default=2, help="requests per level (at least the concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (the mean with a spread)")
    ap.add_argument(
        "--length-spread", type=float, default=0.0, help="output lengths uniform in (1 -/+ this) x --max-tokens"
    )
    ap.add_argument("--reps", type=int, default=1, help="passes per level and server, the order rotating")
    ap.add_argument("--prompts", choices=PROMPT_SET_NAMES, default="sharegpt", help="the requests' source")
    ap.add_argument("--name", default="concurrency_cpu")
    ap.add_argument("--plot", default=str(DOCS / "bench_concurrency.png"))
    ap.add_argument(
        "--servers", nargs="+", default=None, help="a subset of the other server names (smoke runs); the default always runs"
    )
    ap.add_argument(
        "--no-control", dest="control", action="store_false", help="no second default server started last"
    )
    args = ap.parse_args(argv)
    ensure_passive_omp()

    flags = {
        k: v
        for k, v in servers(args.control).items()
        if args.servers is None or k in args.servers or k in ADAPTIVE
    }
    n = max(max(args.concurrency), args.requests) + 1
    lengths = output_lengths(n, args.max_tokens, args.length_spread)  # before the slow part: a bad flag fails here
    questions = prompt_sets([args.prompts], n)[args.prompts]
    requests = list(zip(questions, lengths))
    recorded = vars(args) | {"plot": os.path.relpath(args.plot, HERE.parent)}
    results: dict = {
        "machine": machine_info(),
        "args": recorded,
        "output_lengths": lengths,
        "servers": flags,
        "runs": {},
    }
    with ExitStack() as stack, tempfile.TemporaryDirectory() as logs:
        os.environ["TREEPAGE_CACHE_DIR"] = logs  # the default server calibrates at start-up, as on a fresh machine
        urls = {}
        for i, (name, extra) in enumerate(flags.items()):  # one at a time: start-up (and calibration) alone
            urls[name] = stack.enter_context(launch_server(extra, Path(logs) / f"{i}.log", startup_timeout=600))
        for u in urls.values():
            run_level(u, [(questions[-1], 8)], 1)  # warm-up
        for j, c in enumerate(args.concurrency):
            level = requests[: max(args.requests, c)]
            passes: dict[str, list[dict]] = {name: [] for name in urls}
            served: dict[str, Counter[str]] = {n: Counter() for n in urls if n in ADAPTIVE}  # rounds per shape
            states: dict[str, list[dict]] = {n: [] for n in served}
            for rep in range(args.reps):
                for name in pass_order(list(urls), j * args.reps + rep):
                    before = adaptive_state(urls[name]).get("rounds", {}) if name in served else {}
                    passes[name].append(run_level(urls[name], level, c))
                    if name in served:
                        after = adaptive_state(urls[name])
                        served[name].update(Counter(after.get("rounds", {})) - Counter(before))
                        states[name].append(policy_state(after, c))
            results["runs"][str(c)] = {name: summarize(p) for name, p in passes.items()}
            for name, rounds in served.items():
                results["runs"][str(c)][name]["adaptive_rounds"] = dict(rounds)
                results["runs"][str(c)][name]["policy_state_per_pass"] = states[name]
        info = httpx.get(f"{urls[DEFAULT]}/get_server_info", timeout=10).json()
        results["default_server_info"] = {
            k: info.get(k) for k in ("dtype", "page_size", "spec_version", "speculative_adaptive")
        }
        key = (results["default_server_info"]["speculative_adaptive"] or {}).get("calibration", {}).get("key", {})
        for k in ("model", "draft"):  # no machine paths in committed results
            if k in key:
                key[k] = os.path.basename(key[k])
        results["fixed_accept_length"] = {
            name: httpx.get(f"{u}/get_server_info", timeout=10).json().get("avg_spec_accept_length")
            for name, u in urls.items()
        }

    rows = []
    for c, run in results["runs"].items():
        for name in flags:
            r = run[name]
            rows.append([c, name, r["tok_per_s"], r["median_itl_ms"], r["median_ttft_ms"]])
        for name, key in ADAPTIVE.items():
            if name not in run:
                continue
            vs = run[key] = versus_best(run, name)
            each = " / ".join(f"{r:.3f}" for r in vs["ratio_per_pass"])
            rows.append([c, f"**{name} / best ({vs['best']})**", f"**{vs['ratio']:.3f}** (per pass {each})", "", ""])
    print(machine_line(results["machine"]))
    print_table(
        f"Output tok/s and median ITL over HTTP (streaming), {lengths_line(args.max_tokens, args.length_spread)}, "
        f"max({args.requests}, c) requests per level, {args.reps} pass(es)",
        ["concurrency", "server", "tok/s", "median ITL ms", "median TTFT ms"],
        rows,
    )
    for c, run in results["runs"].items():
        for name in (n for n in ADAPTIVE if n in run):
            print(f"{name}: rounds at concurrency {c}:", run[name].get("adaptive_rounds"))
    plot(results, Path(args.plot))
    print(f"results: {os.path.relpath(write_results(args.name, results))}; plot: {os.path.relpath(args.plot)}")
    return results


if __name__ == "__main__":
    main()
