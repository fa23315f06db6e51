"""In-process API: Engine(server_args).generate(...). The HTTP server is a thin layer over it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from treepage.arg_groups import dtype_choice, resolve_dtype, resolve_server_args
from treepage.arg_groups.speculative import apply_default_server_speculation
from treepage.core import (
    LogprobParams,
    Req,
    SampleGroup,
    SamplingParams,
    TokenLogprob,
    check_num_samples,
    new_rid,
    sample_seed,
)
from treepage.entrypoints.logprob_output import add_native_logprobs
from treepage.layers.grammar import GrammarCompiler
from treepage.layers.penalties import build_chain
from treepage.managers.scheduler import Scheduler
from treepage.managers.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer
from treepage.managers.worker_factory import build_worker
from treepage.models.loader import default_model_path, load_config
from treepage.server_args import ServerArgs
from treepage.speculative.calibrate import load_or_calibrate
from treepage.speculative.eagle_worker import EagleWorker

logger = logging.getLogger(__name__)


Sink = Callable[[dict[str, Any]], None]

# Everyday questions of different kinds (explanation, list, advice, code): adaptive speculation's accept prior.
CALIBRATION_QUESTIONS = (
    "Explain in a few sentences how a bicycle stays upright while it is moving.",
    "Give me three ideas for a quick vegetarian dinner.",
    "How should I prepare for a job interview next week?",
    "Write a Python function that returns the n-th Fibonacci number.",
)


def asyncio_sink(loop: asyncio.AbstractEventLoop, q: asyncio.Queue[dict[str, Any]]) -> Sink:
    """A sink that hands output deltas from the scheduler thread to a consumer on an event loop."""

    def sink(out: dict) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # the consumer's event loop is gone; its request is being aborted
            pass

    return sink


@dataclass
class CumulativeOutput:
    """Consumer side of a request's output deltas: the cumulative snapshot the APIs return."""

    rid: str = ""
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    meta_info: dict[str, Any] = field(default_factory=dict)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output id, when asked
    input_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt entries from logprob.start on

    def add(self, delta: dict[str, Any]) -> None:
        self.rid, self.finished, self.meta_info = delta["rid"], delta["finished"], delta["meta_info"]
        self.text += delta["text_delta"]
        self.output_ids += delta["ids_delta"]
        self.output_logprobs += delta.get("logprobs_delta", [])
        self.input_logprobs += delta.get("input_logprobs_delta", [])

    def snapshot(self) -> dict[str, Any]:
        return {
            **vars(self),
            "output_ids": list(self.output_ids),
            "output_logprobs": list(self.output_logprobs),
            "input_logprobs": list(self.input_logprobs),
        }


class Engine:
    def __init__(self, server_args: ServerArgs | None = None, **kwargs: Any) -> None:
        args = server_args or ServerArgs(**kwargs)
        if args.model_path is None:
            args.model_path = default_model_path()
            apply_default_server_speculation(args)
        config = load_config(args.model_path)
        resolve_server_args(args, config.architecture)
        self.args = args
        if args.random_seed is not None:
            torch.manual_seed(args.random_seed)
        dtype = resolve_dtype(args, args.device)
        self.dtype = dtype
        self.tokenizer = load_tokenizer(args.model_path, args.tokenizer_path)
        self.worker = build_worker(args, config, dtype)
        self.runner = self.worker.runner
        self.model_config = config
        self.context_len = self.worker.pools.context_len
        self.eos_ids = eos_token_ids(self.tokenizer, config)
        self.model_name = args.served_model_name or args.model_path
        self._grammar: GrammarCompiler | None = None  # built by the first constrained request
        self._grammar_lock = threading.Lock()
        if args.speculative_adaptive and not args.speculative_adaptive_debug_cycle:
            assert isinstance(self.worker, EagleWorker)
            table = load_or_calibrate(self.worker, args, dtype, self._calibration_prompts())
            self.worker.set_cost_table(table)
        self.scheduler = Scheduler(args, self.worker, self.tokenizer, self.eos_ids)
        self._thread = threading.Thread(
            target=self.scheduler.run_forever, name="treepage-scheduler", daemon=True
        )
        self._thread.start()
        self.start_time = time.time()

    def _calibration_prompts(self) -> list[list[int]]:
        """General chat questions: the accept lengths they yield are the adaptive policy's prior."""
        out = []
        for question in CALIBRATION_QUESTIONS:
            try:
                out.append(apply_chat_template(self.tokenizer, [{"role": "user", "content": question}]))
            except ValueError:
                out.append(list(self.tokenizer.encode(question)))
        return out

    # ---- requests ----------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def make_sampling_params(self, params: dict | SamplingParams | None) -> SamplingParams:
        if isinstance(params, SamplingParams):
            sp = params
        else:
            params = dict(params or {})
            stop = params.pop("stop", None)
            if isinstance(stop, str):
                stop = [stop]
            known = set(SamplingParams.__dataclass_fields__)
            unknown = set(params) - known
            if unknown:
                raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
            sp = SamplingParams(**params, stop=list(stop or []))
        sp.validate(self.vocab_size)
        given = sp.grammar
        if given is not None:
            self.grammar_compiler().compile(*given)  # an invalid constraint is a 400 before anything is queued
        return sp

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's one grammar compiler (layers/grammar.py), over the model's full logits width."""
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._grammar

    def check_prompt(self, input_ids: list[int], sp: SamplingParams) -> None:
        if not input_ids:
            raise ValueError("the prompt is empty")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in input_ids):
            raise ValueError(f"input_ids must be integers in [0, {self.vocab_size})")
        if len(input_ids) >= self.context_len:
            raise ValueError(
                f"the prompt has {len(input_ids)} tokens; this model's context length is {self.context_len}"
            )
        if len(input_ids) + sp.max_new_tokens > self.context_len:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens: "
                f"{len(input_ids)} in the prompt + {sp.max_new_tokens} max_new_tokens"
            )

    def _make_req(
        self, input_ids: list[int], sp: SamplingParams, sink: Sink, rid: str | None, logprob: LogprobParams | None
    ) -> Req:
        self.check_prompt(input_ids, sp)
        bad = logprob.invalid_field(self.vocab_size, len(input_ids)) if logprob is not None else None
        if bad is not None:
            raise ValueError(f"{bad[0]}: {bad[1]}")
        gen = None
        if not sp.greedy:
            gen = torch.Generator(device=self.args.device)
            gen.manual_seed(sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        grammar = self.grammar_compiler().processor(sp, self.eos_ids) if sp.grammar is not None else None
        chain = build_chain(sp, self.eos_ids, self.vocab_size, self.args.device, grammar)
        req = Req(
            rid or new_rid(),
            list(input_ids),
            sp,
            sink,
            generator=gen,
            created=time.monotonic(),
            logits_processor=chain,
        )
        req.logprob = logprob
        return req

    def submit(
        self,
        input_ids: list[int],
        sp: SamplingParams,
        sink: Sink,
        rid: str | None = None,
        logprob: LogprobParams | None = None,
    ) -> Req:
        """Queue a request; `sink` receives its output deltas (managers/output.py) on the scheduler thread.
        `logprob`: the request's logprobs are computed and delivered only when it is given."""
        req = self._make_req(input_ids, sp, sink, rid, logprob)
        self.scheduler.submit(req)
        return req

    def submit_samples(
        self,
        input_ids: list[int],
        sp: SamplingParams,
        sinks: list[Sink],
        rid: str | None = None,
        logprob: LogprobParams | None = None,
    ) -> list[Req]:
        """Queue n = len(sinks) samples of one prompt (docs/design.md, "Parallel sampling"): sample i is the
        request `{rid}-{i}` and, with a seed, draws with `sample_seed(seed, i)`; `abort(rid)` aborts them all.
        One sink is the plain `submit`."""
        check_num_samples(len(sinks))
        if len(sinks) == 1:
            return [self.submit(input_ids, sp, sinks[0], rid, logprob)]
        base = rid or new_rid()
        group = SampleGroup(base)
        for i, sink in enumerate(sinks):
            sp_i = sp if sp.seed is None else dataclasses.replace(sp, seed=sample_seed(sp.seed, i))
            req = self._make_req(input_ids, sp_i, sink, f"{base}-{i}", logprob)
            req.group = group
            group.members.append(req)
        self.scheduler.submit_all(group.members)
        return group.members

    async def generate_async(
        self,
        input_ids: list[int],
        sampling_params: dict | SamplingParams | None = None,
        rid: str | None = None,
    ) -> AsyncIterator[dict]:
        """Yields cumulative snapshots until finished. Cancelling the iterator aborts the request."""
        sp = self.make_sampling_params(sampling_params)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        req = self.submit(input_ids, sp, asyncio_sink(loop, q), rid)
        acc = CumulativeOutput()
        try:
            while True:
                acc.add(await q.get())
                while not q.empty() and not acc.finished:
                    acc.add(q.get_nowait())  # coalesce what has arrived
                yield acc.snapshot()
                if acc.finished:
                    return
        finally:
            if req.finished is None:
                self.abort(req.rid)

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
        return_text_in_logprobs: bool = False,
    ) -> dict | list[dict]:
        """Blocking generation, single or batched (a batch is submitted at once and decoded together). With
        return_logprob, meta_info carries SGLang's logprob lists (entrypoints/logprob_output.py). With
        `sampling_params["n"] > 1` each prompt gets n samples (docs/design.md, "Parallel sampling") and the
        result is a list, prompt-major: the n samples of the first prompt, then of the next. A list of
        sampling_params gives each prompt its own (e.g. a seed per prompt)."""
        single = isinstance(prompt, str) or (
            input_ids is not None and (len(input_ids) == 0 or isinstance(input_ids[0], int))
        )
        batch_ids: list[list[int]]
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            batch_ids = [self.tokenizer.encode(p) for p in prompts]
        elif single:
            batch_ids = [cast(list[int], input_ids)]
        else:
            batch_ids = list(cast(list[list[int]], input_ids))
        if isinstance(sampling_params, list):  # one dict per prompt, as SGLang's Engine takes them
            if len(sampling_params) != len(batch_ids):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(batch_ids)} prompts")
            per_prompt = [dict(p) for p in sampling_params]
        else:
            per_prompt = [dict(sampling_params or {}) for _ in batch_ids]
        ns = {1 if (k := p.pop("n", None)) is None else k for p in per_prompt} or {1}
        if len(ns) > 1:
            raise ValueError("every prompt of one generate call must ask for the same n")
        n = ns.pop()
        check_num_samples(n)
        sp_list = [self.make_sampling_params(p) for p in per_prompt]
        results: list[queue.Queue[dict[str, Any]]] = [queue.Queue() for _ in range(len(batch_ids) * n)]
        lp = None
        if return_logprob:
            lp = LogprobParams(logprob_start_len, top_logprobs_num, tuple(token_ids_logprob or ()))
        for j, (ids, sp) in enumerate(zip(batch_ids, sp_list)):
            self.submit_samples(ids, sp, [q.put for q in results[j * n : (j + 1) * n]], logprob=lp)
        outs = []
        for q in results:
            acc = CumulativeOutput()
            while not acc.finished:
                try:
                    acc.add(q.get(timeout=1.0))
                except queue.Empty:
                    if not self._thread.is_alive():
                        raise RuntimeError(
                            "the scheduler thread has stopped; the engine cannot serve"
                        ) from None
            snap = acc.snapshot()
            if lp is not None:
                add_native_logprobs(snap, lp, self.tokenizer, return_text_in_logprobs)
            outs.append(snap)
        return outs[0] if single and n == 1 else outs

    def abort(self, rid: str) -> None:
        """Abort a request (all its samples when it has n > 1)."""
        self.scheduler.abort(rid)

    # ---- introspection ----------------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Pages by owner. `used_pages` counts what is not available to a new request: everything in use except
        evictable prefix-cache pages (zero when idle). `cached_pages` = `evictable_pages` + `locked_pages`."""
        a = self.worker.pools.allocator
        rp = self.worker.pools.req_to_token_pool
        cache = self.scheduler.cache
        st = self.scheduler.stats
        return {
            "page_size": a.page_size,
            "total_pages": a.num_pages,
            "free_pages": a.num_free_pages(),
            "used_pages": a.num_used_pages() - cache.evictable_pages(),
            "request_pages": a.num_used_pages() - cache.num_pages,
            "cached_pages": cache.num_pages,
            "evictable_pages": cache.evictable_pages(),
            "locked_pages": cache.locked_pages,
            "used_rows": rp.size - rp.num_free(),
            "row_width": rp.row_width,
            "radix_cache": not cache.disabled,
            "cache_hit_tokens": st.cache_hit_tokens,
            "cache_query_tokens": st.cache_query_tokens,
        }

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.scheduler.is_idle():
                return
            time.sleep(0.01)
        raise TimeoutError("engine did not become idle")

    def get_server_info(self) -> dict:
        st = self.scheduler.stats
        a = self.args
        return {
            "model_path": a.model_path,
            "served_model_name": self.model_name,
            "version": "0.1.0",
            "device": a.device,
            "dtype": str(self.dtype).replace("torch.", ""),
            "dtype_reason": dtype_choice(a, a.device).reason,
            "page_size": a.page_size,
            "attention_backend": a.attention_backend,
            "context_length": self.context_len,
            "max_running_requests": a.max_running_requests,
            "max_total_num_tokens": self.worker.pools.allocator.num_pages * self.worker.pools.allocator.page_size,
            "speculative_algorithm": a.speculative_algorithm,
            "speculative_num_steps": a.speculative_num_steps,
            "speculative_eagle_topk": a.speculative_eagle_topk,
            "speculative_num_draft_tokens": a.speculative_num_draft_tokens,
            "spec_version": a.spec_version,
            "avg_spec_accept_length": self.avg_spec_accept_length(),
            "spec_debug": self.worker.debug.to_dict() if hasattr(self.worker, "debug") else None,
            "speculative_adaptive": self.adaptive_report(),
            "num_running_reqs": st.num_running,
            "num_waiting_reqs": st.num_waiting,
            "gen_throughput": st.gen_throughput,
            "memory": self.memory_report(),
        }

    def avg_spec_accept_length(self) -> float:
        """Tokens emitted per verify round (accepted drafts + the bonus token), over the server's lifetime."""
        dbg = getattr(self.worker, "debug", None)
        return dbg.emitted / dbg.rounds if dbg is not None and dbg.rounds else 0.0

    def adaptive_report(self) -> dict | None:
        """Rounds per shape (and OFF), the accept-length estimates and the cost table, when the shape adapts."""
        policy = getattr(self.worker, "policy", None)
        return policy.snapshot() if policy is not None else None

    def flush_cache(self, timeout: float = 10.0) -> bool:
        """Drop the prefix cache (on the scheduler thread); False when requests are in flight."""
        if not self.scheduler.is_idle() or not self._thread.is_alive():
            return False
        try:
            return self.scheduler.request_flush().result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return False

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop_scheduler(self) -> None:
        """Stop the scheduler thread and keep the models and pools: a benchmark or test then steps the scheduler,
        or drives the worker, on its own thread."""
        self.scheduler.stop()
        self._thread.join(timeout=10)

    def shutdown(self) -> None:
        """Stop the scheduler thread and free the KV pools (`Worker.close`); nothing may run on the engine after."""
        self.stop_scheduler()
        if self._thread.is_alive():  # a loop still stepping would write into freed KV
            logger.warning("the scheduler thread did not stop within 10 s: the KV pools stay allocated")
            return
        self.worker.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- SGLang's load and state reports (read by sglang-router and bench_serving) ---------------------------
    def get_load(self) -> list[dict[str, int]]:
        """SGLang's /get_load: one entry per data-parallel rank (treepage has one); sglang-router's
        power_of_two policy sends a request to the less loaded of two workers by it."""
        s = self.scheduler  # live lengths, not s.stats: those are refreshed only while the loop steps
        waiting = len(s.waiting) + s.inbox.qsize()
        mem = self.memory_report()
        return [
            {
                "dp_rank": 0,
                "num_reqs": len(s.running) + (s.prefilling is not None) + waiting,
                "num_waiting_reqs": waiting,
                "num_tokens": mem["used_pages"] * mem["page_size"],  # KV tokens held, pages rounded up
            }
        ]

    def get_internal_states(self) -> list[dict[str, Any]]:
        """SGLang's `internal_states` (one dict per data-parallel rank); `avg_spec_accept_length` is present only
        when speculation is on, as in SGLang, and is what bench_serving prints as the accept length."""
        state: dict[str, Any] = {
            "dp_rank": 0,
            "effective_max_running_requests_per_dp": self.args.max_running_requests,
            "last_gen_throughput": self.scheduler.stats.gen_throughput,
        }
        if self.args.speculation:
            state["avg_spec_accept_length"] = self.avg_spec_accept_length()
        return [state]
