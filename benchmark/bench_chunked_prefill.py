"""Running requests keep streaming while a long prompt prefills: inter-token latency with and without chunking.

    python benchmark/bench_chunked_prefill.py [--prompt-tokens 4000] [--chunks -1 256 512 1024]

For each --chunked-prefill-size (one engine each, default model, speculation off, page 64, the dtype --dtype
picks): two short requests stream; once they are decoding, a long passage is submitted. The short requests'
inter-token gaps while the long prompt prefills are recorded (max and median), next to the long prompt's
time to first token and the time of one chunk (TTFT / number of chunks). Target: max gap bounded by one
chunk's time (plus a decode round). Results: benchmark/results/<--name>.json plus a markdown table.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402
    ensure_passive_omp,
    machine_info,
    machine_line,
    median,
    passage_ids,
    print_table,
    write_results,
)

from treepage.entrypoints.engine import Engine  # noqa: E402


def measure(chunk: int, prompt_tokens: int, dtype: str) -> dict:
    eng = Engine(
        speculative_algorithm="NONE", page_size=64, dtype=dtype, chunked_prefill_size=chunk, log_level="warning"
    )
    try:
        stamps: dict[str, list[float]] = {"short0": [], "short1": [], "long": []}
        lock = threading.Lock()

        def sink(tag: str, done: queue.Queue):
            def put(delta: dict) -> None:
                with lock:
                    if delta["ids_delta"]:
                        stamps[tag].append(time.perf_counter())
                if delta["finished"]:
                    done.put(tag)

            return put

        done: queue.Queue = queue.Queue()
        short = eng.make_sampling_params({"temperature": 0, "max_new_tokens": 400, "ignore_eos": True})
        for i in range(2):
            eng.submit(passage_ids(eng.tokenizer, 32, offset=i), short, sink(f"short{i}", done))
        while len(stamps["short1"]) < 5:
            time.sleep(0.01)
        t_submit = time.perf_counter()
        long_sp = eng.make_sampling_params({"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
        eng.submit(passage_ids(eng.tokenizer, prompt_tokens, offset=7), long_sp, sink("long", done))
        for _ in range(3):
            done.get(timeout=3600)
        t_first = stamps["long"][0]
        gaps = [
            b - a
            for tag in ("short0", "short1")
            for a, b in zip(stamps[tag], stamps[tag][1:])
            if t_submit <= b and a <= t_first
        ]
        n_chunks = 1 if chunk <= 0 else -(-prompt_tokens // chunk)
        return {
            "chunk": chunk,
            "long_ttft_s": t_first - t_submit,
            "chunks": n_chunks,
            "chunk_s": (t_first - t_submit) / n_chunks,
            "max_gap_s": max(gaps),
            "median_gap_s": median(gaps),
            "gaps_during_prefill": len(gaps),
        }
    finally:
        eng.shutdown()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--chunks", type=int, nargs="+", default=[-1, 256, 512, 1024])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--name", default="chunked_prefill_cpu")
    args = ap.parse_args(argv)
    ensure_passive_omp()
    info = machine_info()
    runs = [measure(c, args.prompt_tokens, args.dtype) for c in args.chunks]
    rows = [
        [
            "off" if r["chunk"] <= 0 else r["chunk"],
            r["chunks"],
            r["long_ttft_s"],
            r["chunk_s"],
            r["max_gap_s"],
            r["median_gap_s"],
            r["max_gap_s"] / r["chunk_s"],
        ]
        for r in runs
    ]
    headers = [
        "chunk size",
        "chunks",
        "long TTFT s",
        "s per chunk",
        "max ITL s (running)",
        "median ITL s",
        "max ITL / chunk time",
    ]
    print(machine_line(info))
    print_table(f"Running requests while a {args.prompt_tokens}-token prompt prefills", headers, rows)
    out = {"machine": info, "args": vars(args), "runs": runs}
    print(write_results(args.name, out))
    return out


if __name__ == "__main__":
    main()
