"""Where the time of a decode step goes with adaptive speculation, at batch 1 and batch 8: the default server's
shape (4, 4, 16) fixed, the shapes the policy picks there ((3, 2, 6) at batch 1, plain decoding at batch 8),
and the adaptive engine itself, after 64 tokens of the same prompts (past its start-up exploration; its rounds
per shape over its life, warm-up and profile together, are recorded). cProfile of spec v1 steps
(`common.profile_decode`; spec v2 would run its rounds on a forward thread the profiler does not see), on the
default server's model, head, dtype and pages, general chat questions, greedy.

    python benchmark/bench_adaptive_profile.py [--batch-sizes 1 8] [--new-tokens 48]

Results: benchmark/results/<--name>.json and a markdown table per configuration.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "scripts"))

from common import (  # noqa: E402
    chat_ids,
    ensure_passive_omp,
    machine_info,
    machine_line,
    print_table,
    profile_decode,
    run_requests,
    write_results,
)
from make_eagle_data import heldout_questions  # noqa: E402

from treepage.entrypoints.engine import Engine  # noqa: E402
from treepage.server_args import ServerArgs  # noqa: E402

CONFIGS: dict[str, dict] = {
    "fixed 4x4x16": {"speculative_num_steps": 4, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 16},
    "fixed 3x2x6": {"speculative_num_steps": 3, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6},
    "off": {"speculative_algorithm": "NONE", "page_size": 64},
    "adaptive": {},
}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--name", default="adaptive_profile_cpu")
    args = ap.parse_args(argv)
    ensure_passive_omp()
    results: dict = {"machine": machine_info(), "args": vars(args), "profiles": {}}
    questions = heldout_questions(max(args.batch_sizes))
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TREEPAGE_CACHE_DIR"] = cache  # the adaptive engine calibrates once, as a fresh server does
        for name in args.configs:
            for B in args.batch_sizes:
                eng = Engine(ServerArgs(log_level="warning", disable_overlap_schedule=True, **CONFIGS[name]))
                prompts = [chat_ids(eng.tokenizer, q) for q in questions[:B]]
                if eng.adaptive_report() is not None:  # past the start-up exploration, with served estimates
                    run_requests(eng, prompts, 64)
                prof = profile_decode(eng, prompts, args.new_tokens)
                report = eng.adaptive_report()
                if report is not None:
                    prof["adaptive_rounds"] = report["rounds"]
                    prof["accept_estimate"] = report["accept_estimate"]
                results["profiles"][f"{name} B{B}"] = prof
                print_table(
                    f"{name}, batch {B}: {prof['steps']} steps, {prof['ms_per_step']:.1f} ms per step, "
                    f"{prof['tokens_per_step']:.2f} tokens per step under the profiler",
                    ["part", "ms per step", "calls per step"],
                    [
                        [lb, prof["parts_ms_per_step"][lb.strip()], prof["calls_per_step"][lb.strip()]]
                        for lb in prof["labels"]
                    ],
                )
                if report is not None:
                    print("adaptive rounds:", report["rounds"])
    print(machine_line(results["machine"]))
    print(f"results: {os.path.relpath(write_results(args.name, results))}")
    return results


if __name__ == "__main__":
    main()
