"""Continuous batching: admit, prefill, decode (plain or speculative rounds), stream, stop, free."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from treepage.managers.schedule_batch import FinishReason, Req
from treepage.managers.utils import ceil_div, get_alloc_reserve_per_decode, next_alloc_target
from treepage.mem_cache.memory_pool import free_row, grow_row
from treepage.speculative.eagle_info_v2 import RowWidthError, check_row_width, reserve_decode_slots

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


class Scheduler:
    def __init__(self, args, worker, tokenizer, eos_ids: list[int]) -> None:
        self.args = args
        self.worker = worker
        self.pools = worker.pools
        self.allocator = worker.pools.allocator
        self.req_pool = worker.pools.req_to_token_pool
        self.page_size = args.page_size
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.context_len = worker.pools.context_len
        self.reserve = get_alloc_reserve_per_decode(args, overlap=args.spec_version == 2)
        self.spec_desc = (
            args.speculative_eagle_topk or 1,
            args.speculative_num_steps or 0,
            args.speculative_num_draft_tokens or 0,
        )
        self.strict = os.environ.get("TREEPAGE_STRICT_MEM_CHECK", "0") == "1"
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.aborts: set[str] = set()
        self.stats = SchedulerStats()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._tput_window: deque[tuple[float, int]] = deque()
        self.flush_requested = False

    # ---- called from other threads -------------------------------------------------------------------------
    def submit(self, req: Req) -> None:
        limit = self.args.max_queued_requests
        if limit is not None and self.inbox.qsize() + len(self.waiting) >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
        self.inbox.put(req)
        self._wake.set()

    def abort(self, rid: str) -> None:
        with self._lock:
            self.aborts.add(rid)
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    # ---- the loop ----------------------------------------------------------------------------------------------
    def run_forever(self) -> None:
        while not self._stop:
            try:
                did = self.step()
            except Exception:  # keep serving: fail the in-flight requests, free them, carry on
                logger.exception("scheduler step failed; aborting the running batch")
                for r in list(self.running):
                    self._finish(r, FinishReason("abort", message="internal error"))
                self.running = []
                did = True
            if not did:
                self._wake.wait(0.05)
                self._wake.clear()

    def step(self) -> bool:
        self._drain_inbox()
        self._apply_aborts()
        if self.flush_requested and not self.running:
            self.flush_requested = False
        admitted = self._admit()
        if admitted:
            self._run_prefill(admitted)
        elif self.running:
            self._run_decode()
        else:
            self.worker.idle()
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
                req = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.waiting.append(req)

    def _apply_aborts(self) -> None:
        with self._lock:
            aborts, self.aborts = self.aborts, set()
        if not aborts:
            return
        for r in [r for r in self.waiting if r.rid in aborts]:
            self.waiting.remove(r)
            self._finish(r, FinishReason("abort", message="aborted by client"))
        for r in [r for r in self.running if r.rid in aborts]:
            self.running.remove(r)
            self._finish(r, FinishReason("abort", message="aborted by client"))
        self.worker.forget([r for r in aborts])

    # ---- admission and prefill ---------------------------------------------------------------------------------
    def _pages_for(self, n_tokens: int) -> int:
        return ceil_div(n_tokens, self.page_size)

    def _admit(self) -> list[Req]:
        admitted: list[Req] = []
        budget = self.args.max_prefill_tokens
        # Keep enough pages for every running request's next round.
        reserved_pages = sum(self._pages_for(self.reserve) + 1 for _ in self.running)
        while self.waiting and len(self.running) + len(admitted) < self.args.max_running_requests:
            req = self.waiting[0]
            n = req.seq_len
            if admitted and n > budget:
                break
            need = self._pages_for(n + self.reserve) + 1
            if need + reserved_pages > self.allocator.num_free_pages():
                if not self.running and not admitted:
                    self.waiting.popleft()
                    self._finish(
                        req,
                        FinishReason(
                            "abort",
                            message=(
                                f"the request needs {need} KV pages but the pool has {self.allocator.num_pages}; "
                                "raise --max-total-tokens"
                            ),
                        ),
                    )
                    continue
                break
            row = self.req_pool.alloc()
            if row is None:
                break
            if not grow_row(self.req_pool, self.allocator, row, 0, n):
                self.req_pool.free(row)
                break
            self.waiting.popleft()
            req.row, req.allocated_len, req.kv_committed_len = row, n, 0
            reserved_pages += need
            budget -= n
            admitted.append(req)
        return admitted

    def _run_prefill(self, reqs: list[Req]) -> None:
        now = time.monotonic()
        new_tokens = self.worker.prefill(reqs)
        for r, toks in zip(reqs, new_tokens):
            if r.first_token_time is None:
                r.first_token_time = now
            self.stats.prompt_tokens_total += len(r.input_ids)
            self.running.append(r)
            self._append_tokens(r, toks)
        self._reap()

    # ---- decode -------------------------------------------------------------------------------------------------
    def _run_decode(self) -> None:
        reqs = self._prepare_for_decode()
        if not reqs:
            return
        new_tokens = self.worker.decode(reqs)
        for r, toks in zip(reqs, new_tokens):
            self._append_tokens(r, toks)
        self._reap()

    def _prepare_for_decode(self) -> list[Req]:
        """Reserve this round's KV (checking the row width first); retract requests when pages run out."""
        while self.running:
            reqs = self.running
            try:
                lens = self._reserve(reqs)
            except RowWidthError:
                self._abort_overflowing_rows(reqs)
                continue
            if lens is not None:
                for r, n in zip(reqs, lens):
                    r.allocated_len = n
                return reqs
            self._retract_one()
        return []

    def _reserve(self, reqs: list[Req]) -> list[int] | None:
        return reserve_decode_slots(
            self.req_pool,
            self.allocator,
            [r.row for r in reqs],
            [r.allocated_len for r in reqs],
            [self.worker.committed_len_for_alloc(r) for r in reqs],
            self.reserve,
            self.page_size,
            self.spec_desc,
        )

    def _abort_overflowing_rows(self, reqs: list[Req]) -> None:
        """The row-width invariant fired: fail exactly the requests whose round would not fit their row."""
        self.worker.forget([])  # drain an in-flight round before touching any request's memory
        for r in list(reqs):
            try:
                check_row_width(
                    [
                        next_alloc_target(
                            r.allocated_len,
                            self.worker.committed_len_for_alloc(r),
                            self.reserve,
                            self.page_size,
                        )
                    ],
                    self.req_pool.row_width,
                    self.page_size,
                    *self.spec_desc,
                )
            except RowWidthError as err:
                logger.error("request %s stopped: %s", r.rid, err)
                self.running.remove(r)
                self.worker.forget([r.rid])
                self._finish(r, FinishReason("abort", message=str(err)))

    def _retract_one(self) -> None:
        victim = max(self.running, key=lambda r: r.created)
        self.running.remove(victim)
        self.worker.forget([victim.rid])
        self._release(victim)
        if not self.running:
            self._finish(victim, FinishReason("abort", message="out of KV memory: raise --max-total-tokens"))
            return
        self.stats.num_retracted += 1
        logger.info("retracting %s (out of KV pages); it will be prefilled again", victim.rid)
        self.waiting.appendleft(victim)

    # ---- outputs ------------------------------------------------------------------------------------------------
    def _append_tokens(self, r: Req, toks: list[int]) -> None:
        if not toks:
            return
        sp = r.sampling
        for t in toks:
            if r.finished is not None:
                break
            r.output_ids.append(t)
            self.stats.gen_tokens_total += 1
            self._tput_window.append((time.monotonic(), 1))
            if not sp.ignore_eos and (t in self.eos_ids or t in sp.stop_token_ids):
                r.finished = FinishReason("stop", matched=t)
            elif len(r.output_ids) >= sp.max_new_tokens:
                r.finished = FinishReason("length", matched=len(r.output_ids))
            elif r.seq_len >= self.context_len:
                r.finished = FinishReason("length", matched=len(r.output_ids))
        self._emit(r)

    def _emit(self, r: Req) -> None:
        """Refresh the text (stop strings may finish the request) and stream it unless it just finished:
        a finished request is streamed by _reap after its memory is released."""
        ids = r.output_ids
        sp = r.sampling
        if r.finished is not None and r.finished.type == "stop" and ids and ids[-1] == r.finished.matched:
            ids = ids[:-1]  # the matched EOS / stop token is not part of the text
        text = self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
        if sp.stop and (r.finished is None or r.finished.type != "abort"):
            for s in sp.stop:
                pos = text.find(s)
                if pos != -1:
                    text = text[:pos]
                    r.finished = FinishReason("stop", matched=s)
                    break
        if r.finished is None and text.endswith("\ufffd"):
            return  # hold back a trailing partial UTF-8 character while streaming
        r.text = text
        if r.finished is None:
            self._deliver(r)

    def _deliver(self, r: Req) -> None:
        """Hand a snapshot to the request's consumer; a broken consumer must not take the batch down."""
        try:
            r.sink(self._snapshot(r))
        except Exception:
            logger.exception("output consumer of %s failed; aborting that request", r.rid)
            if r.finished is None:
                self.abort(r.rid)

    def _snapshot(self, r: Req) -> dict:
        return {
            "rid": r.rid,
            "text": r.text,
            "output_ids": list(r.output_ids),
            "finished": r.finished is not None,
            "meta_info": {
                "id": r.rid,
                "prompt_tokens": len(r.input_ids),
                "completion_tokens": len(r.output_ids),
                "finish_reason": r.finished.to_dict() if r.finished else None,
                "spec_verify_ct": r.spec_verify_ct,
                "spec_accepted_tokens": r.spec_accepted_drafts,
                "spec_accept_length": (len(r.output_ids) - 1) / r.spec_verify_ct if r.spec_verify_ct else 0.0,
            },
        }

    def _reap(self) -> None:
        done = [r for r in self.running if r.finished is not None]
        if not done:
            return
        self.running = [r for r in self.running if r.finished is None]
        self.worker.forget([r.rid for r in done])
        for r in done:
            self._release(r)
            self._deliver(r)

    def _release(self, r: Req) -> None:
        if r.row >= 0:
            free_row(self.req_pool, self.allocator, r.row, 0, r.allocated_len)
            self.req_pool.free(r.row)
        r.row, r.allocated_len, r.kv_committed_len = -1, 0, 0

    def _finish(self, r: Req, reason: FinishReason) -> None:
        r.finished = reason
        self._release(r)
        self._deliver(r)

    # ---- accounting ---------------------------------------------------------------------------------------------
    def check_memory(self, full: bool = True) -> None:
        """Pages and rows in use == those held by resident requests (zero when idle). Runs on every idle tick
        (O(1)); the full structural scan runs there and after every step under TREEPAGE_STRICT_MEM_CHECK=1."""
        held = sum(self._pages_for(r.allocated_len) for r in self.running) + self.worker.extra_pages_held()
        self.allocator.check_leak(expected_used=held, full=full)
        self.req_pool.check_leak(expected_used=len(self.running) + self.worker.extra_rows_held(), full=full)

    def _update_stats(self) -> None:
        now = time.monotonic()
        while self._tput_window and now - self._tput_window[0][0] > 5.0:
            self._tput_window.popleft()
        span = max(now - self._tput_window[0][0], 1e-3) if self._tput_window else 1.0
        self.stats.gen_throughput = sum(n for _, n in self._tput_window) / span
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting) + self.inbox.qsize()
