"""Continuous batching: the loop that owns the queues and calls the worker (docs/design.md, "How a request flows").

Each step: take new requests and aborts, then prefill what `Admission` admits (a long prompt one chunk per step,
alternating with decode rounds), or else run one decode round for the running batch after `DecodePlanner`
reserved its KV (evicting unlocked prefix-cache pages, then retracting the newest request when pages run out).
The `OutputProcessor` appends tokens, stops requests and streams; finished requests are released (their
committed whole pages enter the prefix cache), then delivered. The samples of one prompt (n > 1) are queued
together; the first one prefilled puts its prompt pages in the tree for the others (docs/design.md, "Parallel
sampling").
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from treepage.core import FinishReason, Req
from treepage.layers.logprobs import needs_prompt_logprobs
from treepage.managers.admission import Admission
from treepage.managers.decode_planner import DecodePlanner
from treepage.managers.output import OutputProcessor
from treepage.mem_cache.allocator import MemoryLeakError
from treepage.mem_cache.radix_cache import RadixCache
from treepage.mem_cache.sizing import RowWidthError, get_alloc_reserve_per_decode, max_shape_desc
from treepage.model_executor.worker import Worker
from treepage.server_args import ServerArgs

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    pass


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    gen_tokens_total: int = 0
    prompt_tokens_total: int = 0
    gen_throughput: float = 0.0  # tokens/s over the last window
    num_retracted: int = 0
    cache_hit_tokens: int = 0  # admitted positions not prefilled (prefix cache, a sample group's shared prompt)
    cache_query_tokens: int = 0  # positions admitted (the hit rate's denominator)
    cache_evicted_pages: int = 0


class Scheduler:
    def __init__(self, args: ServerArgs, worker: Worker, tokenizer: object, eos_ids: list[int]) -> None:
        assert args.page_size is not None and args.max_running_requests is not None
        self.args = args
        self.worker = worker
        pools = worker.pools
        self.allocator = pools.allocator
        self.req_pool = pools.req_to_token_pool
        reserve = get_alloc_reserve_per_decode(args, overlap=args.spec_version == 2)
        spec_desc = max_shape_desc(args)
        self.cache = RadixCache(
            self.allocator,
            args.page_size,
            args.radix_eviction_policy,
            disabled=args.disable_radix_cache,
            pair_keys=args.speculation,
        )
        self.admission = Admission(
            pools, reserve, args.page_size, args.max_prefill_tokens, args.chunked_prefill_size or -1, self.cache
        )
        self.planner = DecodePlanner(pools, reserve, args.page_size, spec_desc, self.cache)
        self.output = OutputProcessor(tokenizer, set(eos_ids), pools.context_len, self._count_tokens)
        self.strict = os.environ.get("TREEPAGE_STRICT_MEM_CHECK", "0") == "1"
        self.inbox: queue.Queue[Req] = queue.Queue()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.prefilling: Req | None = None  # a long prompt between two chunks of its prefill
        self._chunk_ran_last = False  # chunks and decode rounds alternate while running requests wait
        self.aborts: set[str] = set()
        self.stats = SchedulerStats()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._tput_window: deque[tuple[float, int]] = deque()
        self._flushes: queue.Queue[Future[bool]] = queue.Queue()

    # ---- called from other threads -------------------------------------------------------------------------
    def submit(self, req: Req) -> None:
        self.submit_all([req])

    def submit_all(self, reqs: list[Req]) -> None:
        """Queue requests in order (the samples of one prompt: all or none)."""
        limit = self.args.max_queued_requests
        if limit is not None and self.inbox.qsize() + len(self.waiting) + len(reqs) > limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
        for req in reqs:
            if req.sampling.max_new_tokens == 0 and not needs_prompt_logprobs(req):  # scoring needs a prefill
                self.output.finish(req, FinishReason("length", matched=0))
                continue
            self.inbox.put(req)
        self._wake.set()

    def abort(self, rid: str) -> None:
        """Abort the request `rid`: one request, or every sample of a request with n > 1."""
        with self._lock:
            self.aborts.add(rid)
        self._wake.set()

    def request_flush(self) -> Future[bool]:
        """Drop the prefix cache on the scheduler thread; the future is False when requests are in flight."""
        fut: Future[bool] = Future()
        self._flushes.put(fut)
        self._wake.set()
        return fut

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    def is_idle(self) -> bool:
        return not self.running and not self.waiting and self.prefilling is None and self.inbox.empty()

    # ---- the loop ----------------------------------------------------------------------------------------------
    def run_forever(self) -> None:
        while not self._stop:
            try:
                did = self.step()
            except Exception:  # keep serving: fail the in-flight requests, free them, carry on
                logger.exception("scheduler step failed; aborting the running batch")
                self._fail_running()
                did = True
            if not did:
                self._wake.wait(0.05)
                self._wake.clear()

    def step(self) -> bool:
        self._drain_inbox()
        self._apply_aborts()
        self._apply_flushes()
        admitted: list[Req] = []
        if self.prefilling is None:
            admitted, too_large = self.admission.admit(
                self.waiting, len(self.running), self.args.max_running_requests or 1
            )
            for r, msg in too_large:
                self.output.finish(r, FinishReason("abort", message=msg))
            copies = self.admission.take_copies()
            if copies is not None:  # admitted samples' partial prompt pages, from a sibling's KV
                self.worker.copy_kv(*copies)
        if self.prefilling is not None and not (self.running and self._chunk_ran_last):
            self._run_prefill([self.prefilling])
        elif admitted:
            self._run_prefill(admitted)
        elif self.running:
            self._run_decode()
        else:
            self.worker.drain()
            if not self.waiting:
                self.check_memory(full=self.strict)
            return False
        if self.strict:
            self.check_memory()
        self._update_stats()
        return True

    def _drain_inbox(self) -> None:
        while True:
            try:
                self.waiting.append(self.inbox.get_nowait())
            except queue.Empty:
                return

    def _apply_aborts(self) -> None:
        with self._lock:
            aborts, self.aborts = self.aborts, set()
        hit = [
            r
            for r in [*self.waiting, *self._resident()]
            if r.rid in aborts or (r.group is not None and r.group.rid in aborts)
        ]
        if hit:
            self._remove(hit, FinishReason("abort", message="aborted by client"))

    def _apply_flushes(self) -> None:
        while True:
            try:
                fut = self._flushes.get_nowait()
            except queue.Empty:
                return
            idle = not self.running and not self.waiting and self.prefilling is None
            if idle:
                self.worker.drain()
                self.cache.flush()
            fut.set_result(idle)

    def _fail_running(self) -> None:
        # Their KV may be half written: free it without caching.
        self._remove(list(self.running), FinishReason("abort", message="internal error"), cache=False)

    def _remove(self, reqs: list[Req], reason: FinishReason, cache: bool = True) -> None:
        """Take requests out of the queues, release their state and memory, deliver their final output."""
        self.worker.release([r.rid for r in reqs])  # drains an in-flight round first
        for r in reqs:  # memory first: is_idle() (read by other threads) must not see freed queues too early
            self.planner.release(r, cache=cache)
        gone = {id(r) for r in reqs}
        self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        self.running = [r for r in self.running if id(r) not in gone]
        if self.prefilling is not None and id(self.prefilling) in gone:
            self.prefilling = None
        for r in reqs:
            self.output.finish(r, reason if r.finished is None else None)

    # ---- prefill and decode -----------------------------------------------------------------------------------
    def _resident(self) -> list[Req]:
        return self.running + ([self.prefilling] if self.prefilling is not None else [])

    def _run_prefill(self, reqs: list[Req]) -> None:
        ends = [self.admission.chunk_end(r) for r in reqs]
        self.prefilling = None
        for r, out, end in zip(reqs, self.worker.prefill(reqs, ends), ends):
            r.kv_committed_len = out.committed_len
            if end < r.seq_len:
                self.output.append(r, out)  # no token yet: only the chunk's prompt logprob entries, if any
                self.prefilling = r
                self.planner.cache_prefix(r)  # requests sharing this prompt can hit it before it finishes
                continue
            self.stats.prompt_tokens_total += len(r.input_ids)
            self.running.append(r)
            self.output.append(r, out)
            if r.group is not None and any(m.row < 0 and not m.output_ids and m.finished is None for m in r.group.members):
                self.planner.cache_prefix(r, shared=True)  # the samples still waiting share this prompt
        self._chunk_ran_last = self.admission.chunked(max(r.seq_len for r in reqs))
        self._reap()

    def _run_decode(self) -> None:
        reqs = self._reserve_round()
        if not reqs:
            return
        for r, out in zip(reqs, self.worker.decode(reqs)):
            r.kv_committed_len = out.committed_len
            self.output.append(r, out)
        self._chunk_ran_last = False
        self._reap()

    def _reserve_round(self) -> list[Req]:
        """Reserve this round's KV (checking the row width first). When pages run out, evict unlocked prefix-cache
        pages first and retract requests only when that is not enough."""
        while self.running:
            try:
                short = self.planner.pages_needed(self.running) - self.allocator.num_free_pages()
                if short > 0 and self.cache.evictable_pages() > 0:
                    self.cache.evict(short)
                if self.planner.reserve_round(self.running):
                    return self.running
            except RowWidthError:
                self.worker.drain()  # before touching any request's memory
                for r, msg in self.planner.overflowing(self.running):
                    logger.error("request %s stopped: %s", r.rid, msg)
                    self._remove([r], FinishReason("abort", message=msg))
                continue
            self._retract(self.planner.pick_victim(self._resident()))
        return []

    def _retract(self, victim: Req) -> None:
        if len(self._resident()) == 1:
            self._remove([victim], FinishReason("abort", message="out of KV memory: raise --max-total-tokens"))
            return
        self.worker.release([victim.rid])
        if victim is self.prefilling:
            self.prefilling = None
        else:
            self.running.remove(victim)
        self.planner.release(victim)
        self.stats.num_retracted += 1
        logger.info("retracting %s (out of KV pages); it will be prefilled again", victim.rid)
        self.waiting.appendleft(victim)

    def _reap(self) -> None:
        done = [r for r in self.running if r.finished is not None]
        if done:
            self._remove(done, FinishReason("abort"))  # each keeps the reason it finished with

    # ---- accounting ---------------------------------------------------------------------------------------------
    def check_memory(self, full: bool = True) -> None:
        """Pages in use == pages held privately by resident requests + pages held by the prefix cache, and rows
        in use == resident requests (no private pages and no rows when idle). Runs on every idle tick (O(1));
        the full structural scan runs there and after every step under TREEPAGE_STRICT_MEM_CHECK=1: the tree's
        own structure and lock counts, and every row's cached prefix backed by tree pages, the rest private."""
        resident = self._resident()
        P = self.admission.page_size
        held = sum(self.admission.pages_for(r.allocated_len) - r.cache_len // P for r in resident)
        self.allocator.check_leak(expected_used=held + self.cache.num_pages, full=full)
        self.req_pool.check_leak(expected_used=len(resident), full=full)
        if full:
            self.cache.check([r.cache_node for r in resident if r.cache_node is not None])
            tree = set(self.cache.all_pages())
            private: set[int] = set()
            for r in resident:
                pages = (self.req_pool.req_to_token[r.row, : r.allocated_len : P] // P).tolist()
                shared, own = pages[: r.cache_len // P], pages[r.cache_len // P :]
                if not tree.issuperset(shared) or tree.intersection(own) or private.intersection(own):
                    raise MemoryLeakError(f"{r.rid}: a row page is both cached and private, or held twice")
                private.update(own)

    def _count_tokens(self, n: int) -> None:
        self.stats.gen_tokens_total += n
        self._tput_window.append((time.monotonic(), n))

    def _update_stats(self) -> None:
        now = time.monotonic()
        while self._tput_window and now - self._tput_window[0][0] > 5.0:
            self._tput_window.popleft()
        span = max(now - self._tput_window[0][0], 1e-3) if self._tput_window else 1.0
        self.stats.gen_throughput = sum(n for _, n in self._tput_window) / span
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting) + self.inbox.qsize()
        self.stats.cache_hit_tokens = self.admission.hit_tokens
        self.stats.cache_query_tokens = self.admission.query_tokens
        self.stats.cache_evicted_pages = self.cache.evicted_pages
