"""Every GPU check in one command, sized for a 10-minute device lease: kernel tests, kernel benchmarks, and
end-to-end engine throughput with speculation on/off on a random-weight Llama-3-8B-shaped model.

    python benchmark/gpu_all.py --out DIR            # CUDA: writes at most 6 files into DIR
    python benchmark/gpu_all.py --out DIR --smoke    # CPU: tiny shapes, no kernel tests / CUDA benches

Each stage runs under its own time budget, capped by what is left of the total; a stage that no longer fits is
recorded as skipped, so a partial run still leaves a complete summary.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmark"))
from common import cpu_info  # noqa: E402

# Fast files first: the kernel file compiles ~100 Triton variants and is the one most likely to hit the limit.
TESTS = [
    "test/speculative/test_tail_dup.py",
    "test/speculative/test_spec_triton_backend.py",
    "test/layers/attention/test_triton_ops.py",
]


@dataclass
class Shape:
    """Target geometry, the draft head's vocabulary and the e2e workload."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    draft_vocab: int
    max_pos: int
    rope_theta: float
    prompt_len: int
    new_tokens: int
    batches: tuple[int, ...]
    spec: tuple[tuple[int, int, int], ...]  # (num_steps, topk, num_draft_tokens)
    accept_lens: tuple[int, ...]
    page_size: int
    kv_tokens: int  # KV pool size (target + draft share it); fixed so start-up skips the memory probe


SPEC = ((5, 8, 32), (3, 1, 4))
# 131072 KV tokens of Llama-3-8B (+ the head's layer) = 17 GiB: room for batch 8 at any tree, fast to allocate.
LLAMA3_8B = Shape(
    4096, 32, 32, 8, 14336, 128256, 32000, 8192, 500000.0, 128, 128, (1, 8), SPEC, (3, 4), 64, 131072
)
# Smoke keeps page 64 (tail duplication across pages is what the GPU run exercises) at a tiny model.
TINY = Shape(64, 2, 4, 2, 128, 128, 64, 512, 10000.0, 8, 16, (1, 2), SPEC, (3,), 64, 16384)


@dataclass
class Stage:
    name: str
    status: str = "pending"  # ok | failed | timeout | skipped: <why>
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)


class Budget:
    def __init__(self, total_s: float) -> None:
        self.end = time.monotonic() + total_s

    def left(self) -> float:
        return self.end - time.monotonic()


# ---- stages 1 and 2: subprocesses ----------------------------------------------------------------------------
def run_logged(stage: Stage, cmd: list[str], log: Path, timeout: float) -> int | None:
    """Runs cmd from the repo root, appending its output to log; None when it ran past timeout."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]),
        PYTHONUNBUFFERED="1",  # a child killed at its timeout still leaves its progress in the log
    )
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[gpu_all] killed after {timeout:.0f}s\n")
            return None
    stage.detail["returncode"] = rc
    return rc


def stage_tests(out: Path, budget: Budget, limit: float) -> Stage:
    st = Stage("pytest")
    log = out / "pytest.log"
    # --maxfail, not -x: one failing test must not hide the other files (a sticky CUDA error ends it fast).
    cmd = [sys.executable, "-m", "pytest", "-q", "--maxfail=10", "--durations=10", *TESTS]
    rc = run_logged(st, cmd, log, min(limit, budget.left()))
    tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
    st.detail["last_line"] = tail[0] if tail else ""
    st.status = "timeout" if rc is None else ("ok" if rc == 0 else "failed")
    return st


def stage_bench_attention(out: Path, budget: Budget, limit: float) -> Stage:
    st = Stage("bench_attention")
    t = min(limit, budget.left())
    dst = out / "bench_attention.json"
    cmd = [
        sys.executable,
        "benchmark/bench_attention.py",
        "--out",
        str(dst),
        "--max-seconds",
        f"{t * 0.6:.0f}",
    ]
    rc = run_logged(st, cmd, out / "benches.log", t)
    st.status = "timeout" if rc is None else ("ok" if rc == 0 else "failed")
    if dst.exists():
        data = json.loads(dst.read_text())
        st.detail["cases"] = len(data["results"])
        st.detail["rows"] = data["results"]
        st.detail["errors"] = data.get("errors", [])
    return st


def stage_bench_tail_dup(out: Path, budget: Budget, limit: float) -> Stage:
    st = Stage("bench_tail_dup")
    src = ROOT / "benchmark" / "results" / "tail_dup_cuda.json"  # the script's fixed output path
    start = time.time()
    rc = run_logged(
        st,
        [sys.executable, "benchmark/bench_tail_dup.py", "--device", "cuda"],
        out / "benches.log",
        min(limit, budget.left()),
    )
    st.status = "timeout" if rc is None else ("ok" if rc == 0 else "failed")
    if src.exists() and src.stat().st_mtime >= start:
        shutil.copyfile(src, out / "bench_tail_dup.json")
        st.detail["copy"] = json.loads(src.read_text()).get("copy", [])
    return st


# ---- stage 3: end-to-end engine -----------------------------------------------------------------------------
def write_models(root: Path, s: Shape) -> tuple[str, str, str]:
    """(target dir, EAGLE-3 head dir, tokenizer dir): configs only (load_format dummy) plus an id tokenizer."""
    from treepage.models.eagle_checkpoint import head_config_dict
    from treepage.models.loader import load_config

    target = root / "target"
    target.mkdir()
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "vocab_size": s.vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": s.rope_theta,
        "max_position_embeddings": s.max_pos,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    (target / "config.json").write_text(json.dumps(cfg, indent=2))
    draft = root / "eagle3"
    draft.mkdir()
    head = head_config_dict(load_config(str(target)), "EAGLE3", draft_vocab_size=s.draft_vocab)
    (draft / "config.json").write_text(json.dumps(head, indent=2))
    return str(target), str(draft), build_id_tokenizer(root / "tokenizer", s.vocab, cfg)


def build_id_tokenizer(d: Path, vocab_size: int, config: dict) -> str:
    """One word per id, so every id the random model emits decodes (the engine detokenizes each step).

    load_tokenizer resolves the path as a checkpoint, which demands a weight file: a one-element placeholder
    safetensors file satisfies it (the model itself is dummy-loaded from its own dir and never reads this)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", bos_token="<1>", eos_token="<2>")
    d.mkdir()
    fast.save_pretrained(str(d))
    (d / "config.json").write_text(json.dumps(config))
    save_file({"placeholder": torch.zeros(1)}, str(d / "model.safetensors"))
    return str(d)


def engine_args(s: Shape, smoke: bool, target: str, tok: str, **spec):
    from treepage.server_args import ServerArgs

    ctx = s.prompt_len + s.new_tokens + 64
    return ServerArgs(
        model_path=target,
        tokenizer_path=tok,
        load_format="dummy",
        device="cpu" if smoke else "cuda",
        dtype="float32" if smoke else "bfloat16",
        attention_backend="torch_native" if smoke else "triton",
        page_size=s.page_size,
        context_length=ctx,
        max_total_tokens=s.kv_tokens,
        max_running_requests=max(s.batches),
        random_seed=0,
        log_level="warning",
        skip_server_warmup=True,
        **spec,
    )


def measure(engine, s: Shape, batch: int) -> dict:
    """Warm up, then time one batch of greedy ignore_eos requests.

    The warm-up runs the full length: split counts and page-table widths grow with the sequence, and each new
    Triton specialization compiles on first use, which must not land in the timed run."""
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, s.vocab, (s.prompt_len,), generator=g).tolist() for _ in range(batch)]
    sp = {"max_new_tokens": s.new_tokens, "temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=prompts, sampling_params=sp)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    dt = time.perf_counter() - t0
    n = sum(len(o["output_ids"]) for o in outs)
    if n != batch * s.new_tokens:  # a failed scheduler step aborts its requests instead of raising
        reasons = sorted({str(o["meta_info"]["finish_reason"]) for o in outs})
        raise RuntimeError(f"{n} of {batch * s.new_tokens} tokens generated; finish reasons {reasons}")
    return {"batch": batch, "output_tokens": n, "seconds": round(dt, 4), "tok_per_s": round(n / dt, 2)}


def e2e_cases(s: Shape, draft: str) -> list[tuple[str, dict]]:
    cases = [("spec_off", {})]
    for accept in s.accept_lens:
        for S, K, N in s.spec:
            spec = dict(
                speculative_algorithm="EAGLE3",
                speculative_draft_model_path=draft,
                speculative_num_steps=S,
                speculative_eagle_topk=K,
                speculative_num_draft_tokens=N,
                speculative_debug_fixed_accept_len=accept,
            )
            cases.append((f"S{S}_K{K}_N{N}_acc{accept}", spec))
    return cases


def stage_e2e(
    s: Shape, smoke: bool, budget: Budget, reserve: float, on_row: Callable[[Stage], None]
) -> Stage:
    """Every case in this process, one engine at a time; on_row(stage) runs after each row (partial saves)."""
    from treepage.entrypoints.engine import Engine

    st = Stage("e2e", "running")
    rows: list[dict] = []
    st.detail["rows"] = rows
    base: dict[int, float] = {}
    last_case_s = 0.0
    with tempfile.TemporaryDirectory(prefix="gpu_all_") as tmp:
        target, draft, tok = write_models(Path(tmp), s)
        for name, spec in e2e_cases(s, draft):
            if budget.left() - reserve < 1.2 * last_case_s:
                rows.append({"case": name, "status": f"skipped: {budget.left():.0f}s left"})
                on_row(st)
                continue
            t0 = time.perf_counter()
            engine = None
            try:
                engine = Engine(engine_args(s, smoke, target, tok, **spec))
                for B in s.batches:
                    r = {"case": name, "status": "ok", **measure(engine, s, B)}
                    r["spec_version"] = engine.args.spec_version
                    if spec:
                        r["avg_accept_len"] = round(engine.avg_spec_accept_length(), 3)
                        r["ratio_vs_off"] = round(r["tok_per_s"] / base[B], 3) if B in base else None
                    else:
                        base[B] = r["tok_per_s"]
                    rows.append(r)
                    on_row(st)
            except Exception as e:  # one broken config must not hide the others' numbers
                rows.append({"case": name, "status": f"failed: {type(e).__name__}: {e}"})
                traceback.print_exc()
                on_row(st)
            finally:
                if engine is not None:
                    engine.shutdown()
                del engine
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            last_case_s = time.perf_counter() - t0
    ok = [r for r in rows if r["status"] == "ok"]
    failed = [r for r in rows if r["status"].startswith("failed")]
    st.status = "failed" if failed else ("ok" if ok else "skipped: no time")
    return st


# ---- stage 4: summary -----------------------------------------------------------------------------------------
def environment() -> dict:
    """Read from package metadata: importing triton here, before the kernels pick interpreter or GPU, is avoided."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        triton_version = version("triton")
    except PackageNotFoundError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        **cpu_info(),  # the host: on a GPU the engine's Python sets the pace (docs/benchmarks_gpu.md)
    }


def markdown(env: dict, stages: list[Stage]) -> str:
    lines = ["# gpu_all", "", "| key | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items() if k != "cpu_flags"]  # the flags: in summary.json
    lines += ["", "| stage | status | seconds | notes |", "|---|---|---|---|"]
    for st in stages:
        notes = st.detail.get("last_line") or (f"{st.detail['cases']} cases" if "cases" in st.detail else "")
        lines.append(f"| {st.name} | {st.status} | {st.seconds:.1f} | {notes} |")
    att = next((st for st in stages if st.name == "bench_attention"), None)
    if att and att.detail.get("rows"):
        keys = list(att.detail["rows"][0])
        lines += ["", "## attention kernels", "", "| " + " | ".join(keys) + " |", "|---" * len(keys) + "|"]
        lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in att.detail["rows"]]
    tail = next((st for st in stages if st.name == "bench_tail_dup"), None)
    if tail and tail.detail.get("copy"):
        keys = list(tail.detail["copy"][0])
        lines += ["", "## tail duplication", "", "| " + " | ".join(keys) + " |", "|---" * len(keys) + "|"]
        lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in tail.detail["copy"]]
    e2e = next((st for st in stages if st.name == "e2e"), None)
    if e2e and e2e.detail.get("rows"):
        lines += ["", "## end-to-end (output tokens/s, greedy, ignore_eos)", ""]
        lines += [
            "| case | batch | tok/s | ratio vs off | accept len | status |",
            "|---|---|---|---|---|---|",
        ]
        for r in e2e.detail["rows"]:
            lines.append(
                f"| {r['case']} | {r.get('batch', '')} | {r.get('tok_per_s', '')} | {r.get('ratio_vs_off', '')} "
                f"| {r.get('avg_accept_len', '')} | {r['status']} |"
            )
    return "\n".join(lines) + "\n"


def write_summary(out: Path, env: dict, smoke: bool, shape: Shape, stages: list[Stage]) -> str:
    """summary.json and summary.md; rewritten after every stage (and e2e row), so a killed run keeps its results."""
    summary = {"env": env, "smoke": smoke, "shape": asdict(shape), "stages": [asdict(s) for s in stages]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = markdown(env, stages)
    (out / "summary.md").write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder (at most 6 files, no subfolders)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: e2e stage only")
    ap.add_argument("--budget-s", type=float, default=None, help="total seconds (default 560, smoke 55)")
    a = ap.parse_args(argv)
    smoke = a.smoke
    if not smoke and not torch.cuda.is_available():
        ap.error("no CUDA device: pass --smoke to run the tiny CPU variant")
    a.out.mkdir(parents=True, exist_ok=True)
    budget = Budget(a.budget_s or (55.0 if smoke else 560.0))
    reserve = 5.0  # summary writing
    shape = TINY if smoke else LLAMA3_8B
    env = environment()
    stages: list[Stage] = []
    # (stage, own limit in seconds); e2e takes whatever is left.
    plan = [("pytest", stage_tests, 150.0), ("bench_attention", stage_bench_attention, 90.0)]
    plan.append(("bench_tail_dup", stage_bench_tail_dup, 60.0))
    for name, fn, limit in plan:
        t0 = time.monotonic()
        if smoke:
            st = Stage(name, "skipped: smoke (CUDA only)")
        elif budget.left() - reserve < 30:
            st = Stage(name, f"skipped: {budget.left():.0f}s left")
        else:
            st = fn(a.out, budget, min(limit, budget.left() - reserve))
        st.seconds = time.monotonic() - t0
        stages.append(st)
        write_summary(a.out, env, smoke, shape, stages)
        print(f"[gpu_all] {name}: {st.status} ({st.seconds:.0f}s)", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    st = stage_e2e(
        shape, smoke, budget, reserve, lambda part: write_summary(a.out, env, smoke, shape, [*stages, part])
    )
    st.seconds = time.monotonic() - t0
    stages.append(st)
    print(f"[gpu_all] e2e: {st.status} ({st.seconds:.0f}s)", file=sys.stderr, flush=True)
    print(write_summary(a.out, env, smoke, shape, stages))
    return 0 if all(s.status == "ok" or s.status.startswith("skipped") for s in stages) else 1


if __name__ == "__main__":
    sys.exit(main())
