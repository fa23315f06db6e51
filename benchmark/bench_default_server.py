"""The default server (no flags: EAGLE-3 with the shipped head, tree drafting on 64-token pages, spec v2) against
the same server with `--speculative-algorithm NONE`, both real `launch_server` processes driven over HTTP by the
official openai client, in one run.

    python benchmark/bench_default_server.py [--num-prompts 8] [--batch-sizes 1 4] [--repeats 2]

Both servers run side by side; every repeat sends the same held-out chat questions (topics the heads never saw)
to each in turn, alternating which goes first, `batch` requests in flight at a time (temperature 0, up to
--max-tokens tokens, stopping at EOS). Throughput = completion tokens / wall time of the whole sweep.
Results: benchmark/results/<--name>.json plus a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "scripts"))
sys.path.insert(0, str(HERE.parent / "test"))

import httpx  # noqa: E402
import openai  # noqa: E402
from common import ensure_passive_omp, machine_info, machine_line, print_table, write_results  # noqa: E402
from make_eagle_data import heldout_questions  # noqa: E402

from server_utils import launch_server  # noqa: E402

# The off server keeps the default server's 64-token pages, so the comparison isolates speculation.
SERVERS = {"spec (default)": [], "spec off": ["--speculative-algorithm", "NONE", "--page-size", "64"]}


def sweep(base_url: str, questions: list[str], batch: int, max_tokens: int) -> dict:
    """All questions, `batch` in flight at a time; returns tokens, seconds and the texts."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=600)

    def ask(q: str):
        r = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": q}], temperature=0, max_tokens=max_tokens
        )
        return r.usage.completion_tokens, r.choices[0].message.content

    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        done = []
        for i in range(0, len(questions), batch):
            done += list(pool.map(ask, questions[i : i + batch]))
    seconds = time.perf_counter() - t0
    return {"tokens": sum(n for n, _ in done), "seconds": seconds, "texts": [t for _, t in done]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--name", default="default_server_cpu")
    args = ap.parse_args(argv)
    ensure_passive_omp()

    questions = heldout_questions(args.num_prompts)
    results: dict = {"machine": machine_info(), "args": vars(args), "questions": questions, "runs": {}}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as logs:
        urls = {
            name: stack.enter_context(launch_server(extra, Path(logs) / f"{i}.log", startup_timeout=300))
            for i, (name, extra) in enumerate(SERVERS.items())
        }
        info = {name: httpx.get(f"{u}/get_server_info", timeout=10).json() for name, u in urls.items()}
        results["server_info"] = {
            name: {k: i.get(k) for k in ("speculative_algorithm", "speculative_num_steps",
                                         "speculative_eagle_topk", "speculative_num_draft_tokens",
                                         "page_size", "spec_version", "dtype", "attention_backend")}
            for name, i in info.items()
        }  # fmt: skip
        for u in urls.values():
            sweep(u, questions[:1], 1, 8)  # warm-up
        for bs in args.batch_sizes:
            acc = {name: {"tokens": 0, "seconds": 0.0} for name in urls}
            for rep in range(args.repeats):
                order = list(urls) if rep % 2 == 0 else list(urls)[::-1]
                for name in order:
                    r = sweep(urls[name], questions, bs, args.max_tokens)
                    acc[name]["tokens"] += r["tokens"]
                    acc[name]["seconds"] += r["seconds"]
                    acc[name]["texts"] = r["texts"]
            for a in acc.values():
                a["tok_per_s"] = round(a["tokens"] / a["seconds"], 2)
            off = acc["spec off"]
            for a in acc.values():
                a["vs_off"] = round(a["tok_per_s"] / off["tok_per_s"], 3)
                a["same_text_as_off"] = sum(x == y for x, y in zip(a["texts"], off["texts"]))
            for a in acc.values():
                del a["texts"]
            results["runs"][str(bs)] = acc
        results["accept_len"] = (
            httpx.get(f"{urls['spec (default)']}/get_server_info", timeout=10)
            .json()
            .get("avg_spec_accept_length")
        )

    rows = [
        [name, bs, a["tok_per_s"], a["vs_off"], f"{a['same_text_as_off']}/{len(questions)}"]
        for bs, run in results["runs"].items()
        for name, a in run.items()
    ]
    print(machine_line(results["machine"]))
    print_table(
        f"Default server vs speculation off over HTTP, {len(questions)} held-out questions x {args.repeats} "
        f"repeats, greedy, up to {args.max_tokens} tokens; accept length {results['accept_len']}",
        ["server", "concurrent requests", "tok/s", "vs off", "same text as off"],
        rows,
    )
    path = write_results(args.name, results)
    print(f"results: {os.path.relpath(path)}")
    return results


if __name__ == "__main__":
    main()
