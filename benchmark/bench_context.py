"""Decode and prefill against context length, treepage vs transformers, fp32 and bf16, side by side in one run.

    python benchmark/bench_context.py [--lengths 32 256 1024 2048 4096] [--batches 1 8] [--steps 12]
    python benchmark/bench_context.py --profile   # where a decode step's time goes: kernel vs torch attention

The default model (SmolLM2-135M), speculation off, page size 1, greedy. Per dtype, one treepage Engine (its
scheduler stepped on this thread) and transformers' LlamaForCausalLM with the same weights (common.load_hf).
For every context length C, interleaved so that background load hits both alike:
  - prefill: one prompt of C tokens to its first token (treepage: the scheduler step that prefills it;
    transformers: one forward that fills a DynamicCache, logits of the last position only), best of --repeats;
  - decode at batch 1 and 8 (prompts of C tokens, prefilled untimed): --steps single-token steps, each timed,
    median. transformers' batch 8 repeats its batch-1 cache 8 times (same shapes, no padding).
Targets (issue 12): treepage decode at 2,048 >= 0.8x its decode at 32; treepage prefill <= 1.0x transformers'
at every length; `--dtype auto` never more than 5 % slower than the other dtype.

--profile: at C in --profile-lengths, blocks of decode steps alternate between the C kernel and the torch path
(gathered, fp32-widened K/V) on the same requests; it reports ms per step, the attention part of it and, for the
torch path, the gather + widen part. Results: benchmark/results/<--name>.json plus markdown tables.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from common import (  # noqa: E402
    ensure_passive_omp,
    load_hf,
    machine_info,
    machine_line,
    median,
    passage_ids,
    print_table,
    write_results,
)

from treepage.arg_groups import cpu_features, dtype_choice  # noqa: E402
from treepage.entrypoints.engine import Engine  # noqa: E402
from treepage.layers.attention import torch_native_backend  # noqa: E402
from treepage.server_args import ServerArgs  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHORT = {"float32": "fp32", "bfloat16": "bf16"}


class Timer:
    """Wall time spent inside a callable, summed; wraps it in place (an attribute of an object or module)."""

    def __init__(self, owner, attr: str) -> None:
        self.owner, self.attr, self.seconds = owner, attr, 0.0
        self.inner = getattr(owner, attr)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return self.inner(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(owner, attr, timed)

    def remove(self) -> None:
        setattr(self.owner, self.attr, self.inner)


def make_engine(dtype: str, max_len: int, max_batch: int, steps: int, chunk: int = -1) -> Engine:
    """The prefix cache is off (a repeated prompt would hit the previous repeat's pages) and, by default, so is
    chunked prefill: the target compares one forward over the prompt on both sides (--chunked-prefill-size
    measures the server's chunked schedule instead)."""
    per_req = max_len + steps + 16
    engine = Engine(
        speculative_algorithm="NONE",
        page_size=1,
        dtype=dtype,
        log_level="warning",
        disable_radix_cache=True,
        chunked_prefill_size=chunk,
        max_total_tokens=max_batch * per_req + 1024,
        max_running_requests=max(8, max_batch),
    )
    engine.stop_scheduler()  # the scheduler is stepped on this thread
    return engine


def submit(engine: Engine, length: int, batch: int, new_tokens: int) -> list:
    sp = engine.make_sampling_params({"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True})
    return [
        engine.submit(passage_ids(engine.tokenizer, length, offset=i), sp, lambda _: None)
        for i in range(batch)
    ]


def finish(engine: Engine, reqs: list) -> None:
    while any(r.finished is None for r in reqs):
        engine.scheduler.step()


class Clock:
    """Wall and process-CPU seconds of a span. On a host shared with other busy processes the CPU time leaves out
    the time this process waited for a core (it still includes memory contention); with one thread it is the
    fairer comparison, with more it sums the threads."""

    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.w0, time.process_time() - self.c0


def treepage_prefill(engine: Engine, length: int) -> Clock:
    """The scheduler step that prefills one prompt of `length` tokens (and samples its first token)."""
    (req,) = submit(engine, length, 1, 1)
    with Clock() as c:
        while not req.output_ids:
            engine.scheduler.step()
    finish(engine, [req])
    return c


def treepage_decode(engine: Engine, length: int, batch: int, steps: int) -> list[Clock]:
    """Each of `steps` decode steps of `batch` requests at context ~`length` (prefills untimed)."""
    reqs = submit(engine, length, batch, steps + 3)
    sched = engine.scheduler
    while any(not r.output_ids for r in reqs):
        sched.step()
    sched.step()  # one untimed decode step
    times = []
    for _ in range(steps):
        with Clock() as c:
            sched.step()
        times.append(c)
    finish(engine, reqs)
    return times


def cache_kw(model) -> str:
    """The KV-cache argument's name: `cache` in newer transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_prefill(model, ids: list[int]):
    """(Clock, cache, next token) of one forward over the prompt, logits of its last position only."""
    from transformers import DynamicCache

    cache = DynamicCache()
    x = torch.tensor([ids])
    with Clock() as c:
        out = model(input_ids=x, use_cache=True, logits_to_keep=1, **{cache_kw(model): cache})
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return c, cache, tok


@torch.inference_mode()
def hf_decode(model, cache, tok: torch.Tensor, steps: int) -> list[Clock]:
    times = []
    for i in range(steps + 1):
        with Clock() as c:
            out = model(input_ids=tok, use_cache=True, **{cache_kw(model): cache})
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        if i:  # the first step is untimed, as on treepage's side
            times.append(c)
    return times


def summary(clocks: list[Clock], best: bool = False) -> dict:
    """Median (decode steps) or best (prefills) of wall and CPU seconds, plus every sample."""
    pick = min if best else median
    return {
        "wall_s": pick([c.wall for c in clocks]),
        "cpu_s": pick([c.cpu for c in clocks]),
        "all_wall_s": [round(c.wall, 5) for c in clocks],
        "all_cpu_s": [round(c.cpu, 5) for c in clocks],
    }


def measure_dtype(dtype: str, args) -> dict:
    engine = make_engine(dtype, max(args.lengths), max(args.batches), args.steps, args.chunked_prefill_size)
    hf = load_hf(engine.args.model_path, DTYPES[dtype], "cpu")
    tok = engine.tokenizer
    treepage_prefill(engine, 64)  # warm-up, both sides
    hf_prefill(hf, passage_ids(tok, 64))
    out: dict = {"prefill": {}, "decode": {}}
    for length in args.lengths:
        ids = passage_ids(tok, length)
        tp, hp, cache, nxt = [], [], None, None
        for _ in range(args.repeats):
            tp.append(treepage_prefill(engine, length))
            c, cache, nxt = hf_prefill(hf, ids)
            hp.append(c)
        out["prefill"][length] = {"treepage": summary(tp, best=True), "hf": summary(hp, best=True)}
        p = out["prefill"][length]
        print(f"  {dtype} prefill {length}: treepage {p['treepage']['wall_s']:.3f} s, transformers "
              f"{p['hf']['wall_s']:.3f} s (wall)", flush=True)  # fmt: skip
        for batch in args.batches:
            t_steps = treepage_decode(engine, length, batch, args.steps)
            hf_cache = copy.deepcopy(cache)  # the prompt's cache, repeated per request
            if batch > 1:
                hf_cache.batch_repeat_interleave(batch)
            h_steps = hf_decode(hf, hf_cache, nxt.repeat(batch, 1), args.steps)
            del hf_cache
            d = out["decode"][f"{length}x{batch}"] = {
                "length": length,
                "batch": batch,
                "treepage": summary(t_steps),
                "hf": summary(h_steps),
            }
            for side in ("treepage", "hf"):
                d[side]["tok_s_wall"] = batch / d[side]["wall_s"]
                d[side]["tok_s_cpu"] = batch / d[side]["cpu_s"]
            print(f"  {dtype} decode {length} x{batch}: treepage {d['treepage']['tok_s_wall']:.1f} tok/s, "
                  f"transformers {d['hf']['tok_s_wall']:.1f} (wall)", flush=True)  # fmt: skip
    engine.scheduler.check_memory()
    del hf, engine
    return out


def profile_dtype(dtype: str, args) -> dict:
    """Alternating blocks of decode steps, C kernel vs torch path, on the same requests."""
    engine = make_engine(
        dtype, max(args.profile_lengths), max(args.batches), 2 * args.rounds * (args.steps + 1)
    )
    backend = engine.runner.attn_backend
    res = {}
    for length in args.profile_lengths:
        for batch in args.batches:
            reqs = submit(engine, length, batch, 2 * args.rounds * (args.steps + 1) + 2)
            sched = engine.scheduler
            while any(not r.output_ids for r in reqs):
                sched.step()
            parts = {
                m: {"step": [], "step_cpu": [], "attention": [], "gather_widen": []}
                for m in ("kernel", "torch")
            }
            for _ in range(args.rounds):
                for mode in ("kernel", "torch"):
                    backend.use_kernel = mode == "kernel"
                    sched.step()  # untimed step after the switch
                    attn = Timer(backend, "forward")
                    gather = Timer(torch_native_backend, "gather_head_major_fp32")
                    with Clock() as c:
                        for _ in range(args.steps):
                            sched.step()
                    step = c.wall / args.steps
                    parts[mode]["step_cpu"].append(c.cpu / args.steps * 1e3)
                    attn.remove()
                    gather.remove()
                    parts[mode]["step"].append(step * 1e3)
                    parts[mode]["attention"].append(attn.seconds / args.steps * 1e3)
                    parts[mode]["gather_widen"].append(gather.seconds / args.steps * 1e3)
            backend.use_kernel = True
            finish(engine, reqs)
            res[f"{length}x{batch}"] = {
                "length": length,
                "batch": batch,
                "ms": parts,
                "median_ms": {m: {k: median(v) for k, v in p.items()} for m, p in parts.items()},
            }
            med = res[f"{length}x{batch}"]["median_ms"]
            print(f"  {dtype} {length} x{batch}: {med}", flush=True)
    engine.scheduler.check_memory()
    return res


def decode_tables(results: dict, args, clock: str) -> None:
    auto, runs = results["auto_dtype"], results["runs"]
    for batch in args.batches:
        rows = []
        for length in args.lengths:
            row = [length]
            for dt in runs:
                d = runs[dt]["decode"][f"{length}x{batch}"]
                t, h = d["treepage"][f"tok_s_{clock}"], d["hf"][f"tok_s_{clock}"]
                row += [t, h, t / h]
            rows.append(row)
        print_table(
            f"Decode, batch {batch}: tok/s from the median step's {clock} time; auto dtype here = {auto}",
            ["context"] + [c for dt in runs for c in (f"{SHORT[dt]} treepage", f"{SHORT[dt]} HF", "ratio")],
            rows,
        )
    rows = []
    for length in args.lengths:
        row = [length]
        for dt in runs:
            p = runs[dt]["prefill"][length]
            t, h = p["treepage"][f"{clock}_s"], p["hf"][f"{clock}_s"]
            row += [t, h, t / h]
        rows.append(row)
    print_table(
        f"Prefill, batch 1: seconds ({clock}, best of {args.repeats})",
        ["context"] + [c for dt in runs for c in (f"{SHORT[dt]} treepage", f"{SHORT[dt]} HF", "treepage / HF")],
        rows,
    )


def targets(results: dict, args, clock: str) -> dict:
    """The issue's three targets on one clock, each with its measured ratio and whether it is met."""
    runs, auto = results["runs"], results["auto_dtype"]
    other = "float32" if auto == "bfloat16" else "bfloat16"
    out: dict = {"decode_2048_vs_32": {}, "prefill_vs_hf": {}, "auto_vs_other_dtype": {}}

    def tps(dt: str, length: int, batch: int) -> float:
        return runs[dt]["decode"][f"{length}x{batch}"]["treepage"][f"tok_s_{clock}"]

    def pre(dt: str, length: int, side: str = "treepage") -> float:
        return runs[dt]["prefill"][length][side][f"{clock}_s"]

    if 32 in args.lengths and 2048 in args.lengths:
        for dt in runs:
            for batch in args.batches:
                r = tps(dt, 2048, batch) / tps(dt, 32, batch)
                out["decode_2048_vs_32"][f"{dt} x{batch}"] = {"ratio": r, "met": r >= 0.8}
    for dt in runs:
        for length in args.lengths:
            r = pre(dt, length) / pre(dt, length, "hf")
            out["prefill_vs_hf"][f"{dt} {length}"] = {"ratio": r, "met": r <= 1.0}
    if other in runs and auto in runs:  # ratio = auto's time / the other dtype's time
        for length in args.lengths:
            r = pre(auto, length) / pre(other, length)
            out["auto_vs_other_dtype"][f"prefill {length}"] = {"ratio": r, "met": r <= 1.05}
            for batch in args.batches:
                r = tps(other, length, batch) / tps(auto, length, batch)
                out["auto_vs_other_dtype"][f"decode {length} x{batch}"] = {"ratio": r, "met": r <= 1.05}
    return out


def plot(results: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.batches), figsize=(5.5 * len(args.batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], args.batches):
        for dt, style in zip(results["runs"], ("-", "--")):
            d = results["runs"][dt]["decode"]
            ys = [d[f"{n}x{batch}"] for n in args.lengths]
            ax.plot(
                args.lengths, [y["treepage"]["tok_s_cpu"] for y in ys], "o" + style, label=f"treepage {dt}"
            )
            ax.plot(args.lengths, [y["hf"]["tok_s_cpu"] for y in ys], "s" + style, label=f"transformers {dt}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tok/s (CPU time of the median step)")
        ax.set_title(f"batch {batch}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 256, 1024, 2048, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per measurement")
    ap.add_argument("--repeats", type=int, default=2, help="prefills per length and side (best counts)")
    ap.add_argument(
        "--chunked-prefill-size", type=int, default=-1, help="treepage's prefill chunk (-1: one forward, as HF)"
    )
    ap.add_argument("--profile", action="store_true", help="kernel vs torch attention breakdown instead")
    ap.add_argument("--profile-lengths", type=int, nargs="+", default=[32, 2048])
    ap.add_argument("--rounds", type=int, default=3, help="--profile: alternations kernel / torch path")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of decode tok/s vs context")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    ensure_passive_omp()

    auto = dtype_choice(ServerArgs(dtype="auto"), "cpu")
    features = cpu_features()
    results: dict = {
        "machine": machine_info(),
        "cpu_features": sorted(k for k, v in features.items() if v),  # torch's run-time probe
        "auto_dtype": str(auto.dtype).removeprefix("torch."),
        "auto_dtype_reason": auto.reason,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": {},
    }
    t_start = time.perf_counter()
    for dt in args.dtypes:
        print(f"{dt} ...", flush=True)
        results["runs"][dt] = profile_dtype(dt, args) if args.profile else measure_dtype(dt, args)
    results["wall_s"] = time.perf_counter() - t_start
    print(machine_line(results["machine"]))
    print(f"--dtype auto here: {results['auto_dtype']} ({auto.reason})")
    if args.profile:
        for dt in args.dtypes:
            rows = []
            for v in results["runs"][dt].values():
                k, t = v["median_ms"]["kernel"], v["median_ms"]["torch"]
                rows.append([v["length"], v["batch"], t["step"], t["step_cpu"], t["attention"], t["gather_widen"],
                             k["step"], k["step_cpu"], k["attention"], t["step"] / k["step"]])  # fmt: skip
            print_table(
                f"Decode step profile, {dt}: ms per step, wall unless marked CPU (median of {args.rounds} blocks "
                f"of {args.steps})",
                [
                    "context",
                    "batch",
                    "torch path step",
                    "(CPU)",
                    "attention",
                    "of it gather+widen",
                    "kernel step",
                    "(CPU)",
                    "attention",
                    "speed-up (wall)",
                ],  # fmt: skip
                rows,
            )
    else:
        results["targets"] = {}
        for clock in ("wall", "cpu"):
            decode_tables(results, args, clock)
            results["targets"][clock] = targets(results, args, clock)
            for group, items in results["targets"][clock].items():
                for k, v in items.items():
                    print(
                        f"  target ({clock}) {group} {k}: {v['ratio']:.3f} {'met' if v['met'] else 'NOT met'}"
                    )
        if args.plot:
            plot(results, args, args.plot)
    name = args.name or ("context_profile_cpu" if args.profile else "context_cpu")
    print(f"results: {write_results(name, results)} ({results['wall_s']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
