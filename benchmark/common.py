"""Shared benchmark helpers: machine description, timing, request submission, JSON results, markdown tables.

The benchmarks run as scripts (`python benchmark/bench_X.py`), so this module is imported as `common`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import queue
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Short chat questions: the prompts every benchmark shares, so numbers are comparable across runs.
QUESTIONS = [
    "What is the capital of France? Answer in one paragraph.",
    "Explain photosynthesis in simple terms.",
    "Write a short poem about the sea.",
    "How do I sort a list of numbers in Python?",
    "Give three tips for staying focused while studying.",
    "Why is the sky blue?",
    "Describe how a bicycle works.",
    "What are the main differences between cats and dogs as pets?",
]

# Filler text for prompts of a chosen token length (plain prose, so the model sees natural input).
PASSAGE = (
    "The history of the printing press begins long before Gutenberg. Carved wooden blocks were used to print "
    "patterns on cloth and, later, whole pages of text. Movable type made of baked clay appeared in China in the "
    "eleventh century, and metal type followed in Korea. In Europe, the combination of a screw press, oil-based "
    "ink and an adjustable mould for casting letters made printing fast and cheap. Books that had taken months "
    "to copy by hand could be produced by the hundred in weeks. Literacy spread, prices fell, and ideas moved "
    "across borders faster than any ruler could control. Scientists shared measurements, reformers spread "
    "pamphlets, and merchants printed price lists. The press changed how people learned, argued and worked. "
)


def ensure_passive_omp() -> None:
    """Re-exec once with OMP_WAIT_POLICY=PASSIVE unless the caller chose a policy.

    With the default (spinning) policy, an OpenMP barrier whose sibling thread was preempted costs a whole
    scheduler slice; on a shared 2-core machine that made a decode step 10-20x slower, and two threads that both
    run torch ops (a scheduler and a forward thread, or HF on the main thread next to the engine's scheduler)
    make each other's teams spin. The policy is applied to both sides of every comparison.
    """
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.execv(sys.executable, [sys.executable, *sys.argv])


def code_version() -> dict[str, Any]:
    """The commit the numbers belong to, and whether the package had uncommitted edits (others work live)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty_files": git("status", "--porcelain", "python").splitlines(),
    }


def cpu_info() -> dict[str, Any]:
    """The host CPU: model name, logical CPUs and the kernel's feature flags (what `lscpu` prints). Every result
    records it, GPU runs included: the host runs the engine's Python and, on a GPU, sets its pace."""
    from treepage.arg_groups import parse_cpuinfo_features

    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "unknown")
    return {"cpu_model": model, "nproc": os.cpu_count(), "cpu_flags": sorted(parse_cpuinfo_features(text))}


# Environment variables that keep torch, oneDNN and MKL (and so the C kernels, layers/cpu_build.py) below the
# CPU's own vector ISA: `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2` runs a
# CPU with AVX-512 as one without AVX-512 or native bf16.
ISA_CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (the docs quote this)."""
    cpu = cpu_info()
    flags = set(cpu["cpu_flags"])
    import transformers

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": cpu["nproc"],
        "cpu_model": cpu["cpu_model"],
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "cpu_flags": cpu["cpu_flags"],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        # The vector ISA torch dispatches to, and what caps it (a lesser CPU measured on this one)
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_caps": {k: os.environ[k] for k in ISA_CAP_VARS if k in os.environ},
        "code": code_version(),
        "loadavg_at_start": os.getloadavg(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(result, wall seconds); synchronizes CUDA so GPU work is inside the interval."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


PROMPT_SET_NAMES = ("sharegpt", "old", "everyday")
# Later user turns of the ShareGPT held-out conversations: its prompts are dialogues whose earlier replies the
# target writes (bench_heads.later_turn_prompts), so they exist only per engine; its size counts conversations.
DIALOGUE_SET = "sharegpt_turns"
DEFAULT_SET_SIZE = 16


def prompt_sets(names: Sequence[str], n: int | Mapping[str, int | None]) -> dict[str, list[str]]:
    """The first n prompts of each named set, all outside every head's training data: ShareGPT first turns of the
    held-out conversations, the template domain's held-out questions ("old"), and the hand-written everyday
    requests (benchmark/everyday_prompts.py) spread over every kind. n: one count for every set, or a count per
    set name (a name it lacks: DEFAULT_SET_SIZE; None: every prompt of the set)."""
    scripts = str(Path(__file__).resolve().parent.parent / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from everyday_prompts import EVERYDAY_PROMPTS
    from make_eagle_data import heldout_questions, sharegpt_heldout_questions

    def everyday(k: int | None) -> list[str]:
        k = k or len(EVERYDAY_PROMPTS)
        return [EVERYDAY_PROMPTS[i * len(EVERYDAY_PROMPTS) // k] for i in range(k)]

    make = {"sharegpt": sharegpt_heldout_questions, "old": heldout_questions, "everyday": everyday}
    return {name: make[name](set_size(n, name)) for name in names}


def set_size(n: int | Mapping[str, int | None], name: str) -> int | None:
    """The count asked for set `name`: one count for every set, or its own (DEFAULT_SET_SIZE if not named)."""
    return n if isinstance(n, int) else n.get(name, DEFAULT_SET_SIZE)


def parse_set_sizes(items: Sequence[str]) -> int | dict[str, int | None]:
    """`--set-size` values: one count for every set ("16"), or NAME=COUNT per set, COUNT "all" for the whole set
    ("sharegpt=all everyday=all old=64")."""
    if len(items) == 1 and "=" not in items[0]:
        return int(items[0])
    sizes: dict[str, int | None] = {}
    names = (*PROMPT_SET_NAMES, DIALOGUE_SET)
    for item in items:
        name, _, count = item.partition("=")
        if name not in names or not count:
            raise ValueError(f"--set-size: expected NAME=COUNT with NAME in {names}, got {item!r}")
        sizes[name] = None if count == "all" else int(count)
    return sizes


def chat_ids(tokenizer, question: str) -> list[int]:
    from treepage.managers.tokenizer import apply_chat_template

    return apply_chat_template(tokenizer, [{"role": "user", "content": question}])


def passage_ids(tokenizer, n_tokens: int, offset: int = 0) -> list[int]:
    """Exactly n_tokens of prose (repeating PASSAGE), starting `offset` tokens in so prompts differ."""
    base = tokenizer.encode(PASSAGE, add_special_tokens=False)
    need = n_tokens + offset
    ids = base * (need // len(base) + 1)
    return ids[offset : offset + n_tokens]


@dataclass
class BatchRun:
    outputs: list[dict]  # the engine's final snapshot per request, in submission order
    seconds: float  # first submit -> last request finished

    @property
    def output_tokens(self) -> int:
        return sum(len(o["output_ids"]) for o in self.outputs)


def run_requests(
    engine,
    prompts: Sequence[list[int]],
    max_new_tokens: Sequence[int] | int,
    ignore_eos: bool = True,
) -> BatchRun:
    """Submit all prompts at once (each with its own max_new_tokens), greedy, and wait for all of them."""

    from treepage.entrypoints.engine import CumulativeOutput

    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    sinks: list[queue.Queue] = [queue.Queue() for _ in prompts]
    t0 = time.perf_counter()
    for ids, n, q in zip(prompts, max_new_tokens, sinks):
        sp = engine.make_sampling_params({"max_new_tokens": n, "temperature": 0.0, "ignore_eos": ignore_eos})
        engine.submit(list(ids), sp, q.put)
    outs = []
    for q in sinks:
        acc = CumulativeOutput()
        while not acc.finished:
            acc.add(q.get())
        outs.append(acc.snapshot())
    return BatchRun(outs, time.perf_counter() - t0)


def load_hf(path: str, dtype: torch.dtype, device: str):
    """transformers' own LlamaForCausalLM with exactly the weights treepage loads (a GGUF is dequantized).

    (`from_pretrained(dir, gguf_file=...)` would need `accelerate`, which is not a project dependency; the
    modeling code, generate loop and KV cache are transformers' either way.)
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from treepage.models.loader import load_config, load_state_dict

    cfg = load_config(path)
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.hf_config.items() if k != "architectures"})
    model = LlamaForCausalLM(hf_cfg)
    missing, unexpected = model.load_state_dict(load_state_dict(path), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.generation_config.eos_token_id = None  # decode through EOS, as treepage's ignore_eos does
    return model.to(device=device, dtype=dtype).eval()


def write_results(name: str, data: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    print(f"\n### {title}\n\n{markdown_table(headers, rows)}\n", flush=True)


def machine_line(info: dict[str, Any]) -> str:
    bf16 = "AVX512-BF16" if info.get("avx512_bf16") else "no AVX512-BF16"
    bf16 += ", AMX" if info.get("amx_bf16") else ", no AMX"
    if info.get("isa_caps"):
        bf16 += ", capped: " + " ".join(f"{k}={v}" for k, v in info["isa_caps"].items())
    return (
        f"{info['date']}; {info['nproc']} CPUs ({info['cpu_model']}, {bf16}), torch {info['torch']} "
        f"({info['torch_threads']} threads, OMP_WAIT_POLICY={info.get('omp_wait_policy')}), transformers "
        f"{info['transformers']}, Python {info['python']}; load average at start "
        f"{' / '.join(f'{x:.1f}' for x in info['loadavg_at_start'])} (1/5/15 min, other users share the CPU); "
        f"code {info['code']['commit']}{' + uncommitted edits' if info['code']['dirty_files'] else ''}"
    )


def step_parts() -> list[tuple[str, tuple[Callable, ...]]]:
    """The parts of a decode step or a speculative round: (label, the functions whose time it sums). Indented
    labels are inside the ones above them; times are cumulative (a function's callees included)."""
    from treepage.managers.scheduler import Scheduler
    from treepage.mem_cache.memory_pool import KVPool
    from treepage.models.llama import LlamaForCausalLM
    from treepage.models.llama_eagle import LlamaForCausalLMEagle
    from treepage.models.llama_eagle3 import LlamaForCausalLMEagle3
    from treepage.speculative import draft_layout, eagle_tree, eagle_verify
    from treepage.speculative.adaptive import AdaptivePolicy
    from treepage.speculative.eagle_worker import EagleWorker

    return [
        ("scheduler step (everything)", (Scheduler.step,)),
        ("  reserve KV (reserve_round)", (Scheduler._reserve_round,)),
        ("  speculative round (EagleWorker.run_round)", (EagleWorker.run_round,)),
        (
            "  adaptive policy: choose + observe + sub-tree accepts",
            (AdaptivePolicy.choose, AdaptivePolicy.observe, EagleWorker._subtree_accepts),
        ),
        (
            "    target forward: decode, or verify of N tree tokens (Llama forward + logits)",
            (LlamaForCausalLM.forward, LlamaForCausalLM.compute_logits),
        ),
        (
            "    draft head forwards: tree steps + extend (EAGLE-3 / EAGLE layers)",
            (LlamaForCausalLMEagle3.forward, LlamaForCausalLMEagle.forward),
        ),
        ("    draft lm_head + softmax + top-K (tree steps + extend)", (EagleWorker._draft_topk,)),
        ("    draft extend over the accepted tokens (its forward + lm_head)", (EagleWorker._draft_extend,)),
        (
            "    prefix-tail duplication (holey layout)",
            (draft_layout.duplicate_prefix_tail_to_draft_branches,),
        ),
        ("    draft slot computation (draft_layout)", (draft_layout.draft_out_cache_loc,)),
        ("    lane regather (K > 1)", (EagleWorker._regather_lanes,)),
        ("    build_tree", (eagle_tree.build_tree,)),
        ("    greedy tree verify", (eagle_verify.verify_tree_greedy,)),
        ("    move_kv_cache (accepted KV, regather, tail dup)", (KVPool.move_kv_cache,)),
    ]


def profile_decode(engine, prompts: Sequence[list[int]], new_tokens: int) -> dict[str, Any]:
    """cProfile of the decode steps of `prompts` (submitted together) stepped on this thread.

    The engine's own scheduler thread is stopped first; spec v2 would run its rounds on a forward thread that
    the profiler does not see, so profile a spec v1 engine (`disable_overlap_schedule=True`): same round.
    """
    import cProfile
    import inspect
    import pstats

    run_requests(engine, [prompts[0]], 6)  # warm-up
    engine.wait_idle()
    engine.stop_scheduler()
    sched = engine.scheduler
    sp = engine.make_sampling_params({"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True})
    reqs = [engine.submit(list(p), sp, lambda out: None) for p in prompts]
    while any(not r.output_ids for r in reqs):
        sched.step()  # prefill, outside the profile
    tokens0 = sum(len(r.output_ids) for r in reqs)
    steps = 0
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    while any(r.finished is None for r in reqs):
        sched.step()
        steps += 1
    pr.disable()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in reqs) - tokens0
    stats = pstats.Stats(pr).stats
    per = max(steps, 1)
    parts = step_parts()
    ms: dict[str, float] = {}
    calls: dict[str, float] = {}
    for label, fns in parts:
        codes = [inspect.unwrap(fn).__code__ for fn in fns]
        hits = [stats.get((c.co_filename, c.co_firstlineno, c.co_name), (0, 0, 0.0, 0.0)) for c in codes]
        ms[label.strip()] = round(sum(h[3] for h in hits) * 1e3 / per, 3)
        calls[label.strip()] = round(max(h[1] for h in hits) / per, 2)  # the functions run side by side
    return {
        "batch": len(prompts),
        "steps": steps,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "ms_per_step": round(wall * 1e3 / per, 2),
        "tokens_per_step": round(tokens / per, 3),
        "parts_ms_per_step": ms,
        "calls_per_step": calls,
        "labels": [label for label, _ in parts],
    }
