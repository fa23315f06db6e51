"""The output side of the scheduler: append a step's tokens, decide when a request stops, stream deltas.

A consumer receives dicts `{"rid", "text_delta", "ids_delta", "finished", "meta_info"}`: only what is new, so a
step costs time in proportion to its new tokens. Text is streamed only once it is final: an incomplete UTF-8
character and a tail that could begin a stop string are held back (the stop string itself is never sent).
A request that asks for logprobs also gets `logprobs_delta` (one `TokenLogprob` per id of ids_delta) and
`input_logprobs_delta` (prompt entries in position order from `logprob.start`, each position once even when a
retraction runs the prompt again).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from treepage.core import FinishReason, Req, StepOutput, TokenLogprob
from treepage.managers.detokenizer import IncrementalDetokenizer, held_stop_prefix

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_ids: set[int], context_len: int, on_tokens: Callable[[int], None]):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.context_len = context_len
        self.on_tokens = on_tokens  # throughput accounting
        self.held: dict[str, str] = {}  # rid -> decoded text not streamed yet
        self.last_ids: dict[str, list[int]] = {}  # rid -> ids of a finished request, delivered by finish()
        self.logprobs: dict[str, list[TokenLogprob]] = {}  # rid -> entries of output ids not delivered yet
        self.input_logprobs: dict[str, list[TokenLogprob]] = {}  # rid -> prompt entries not delivered yet

    def append(self, r: Req, out: StepOutput) -> None:
        """Take a step's tokens up to the first that finishes the request; stream what is final. A chunk of a
        chunked prefill has no tokens, only the prompt logprob entries it computed (sent with the first token)."""
        if out.input_logprobs:
            self._take_input_logprobs(r, out.input_logprobs_start, out.input_logprobs)
        sp = r.sampling
        if sp.max_new_tokens == 0 and out.tokens:  # a prompt-scoring request: its prefill's token is not output
            r.finished = FinishReason("length", matched=0)
            return
        if r.first_token_time is None and out.tokens:
            r.first_token_time = time.monotonic()
        if out.verified and out.tokens:
            r.spec_verify_ct += 1
            r.spec_accepted_drafts += len(out.tokens) - 1
        new: list[int] = []
        for t in out.tokens:
            if r.finished is not None:
                break
            r.output_ids.append(t)
            new.append(t)
            if not sp.ignore_eos and (t in self.eos_ids or t in sp.stop_token_ids):
                r.finished = FinishReason("stop", matched=t)
            elif len(r.output_ids) >= sp.max_new_tokens or r.seq_len >= self.context_len:
                r.finished = FinishReason("length", matched=len(r.output_ids))
        if not new:
            return
        if out.logprobs is not None:
            self.logprobs.setdefault(r.rid, []).extend(out.logprobs[: len(new)])
        self.on_tokens(len(new))
        text_ids = new[:-1] if r.finished is not None and r.finished.type == "stop" else new
        self._emit(r, new, text_ids)

    def _take_input_logprobs(self, r: Req, first: int, entries: list[TokenLogprob]) -> None:
        """Keep the entries of positions not taken yet: a prefill that runs again after a retraction repeats some."""
        assert r.logprob is not None
        expected = r.logprob.start + r.input_logprobs_len
        if first > expected:
            logger.error("%s: prompt logprobs from position %d, expected %d; dropped", r.rid, first, expected)
            return
        fresh = entries[expected - first :]
        self.input_logprobs.setdefault(r.rid, []).extend(fresh)
        r.input_logprobs_len += len(fresh)

    def _emit(self, r: Req, new_ids: list[int], text_ids: list[int]) -> None:
        if r.detok is None:
            r.detok = IncrementalDetokenizer(self.tokenizer, r.sampling.skip_special_tokens)
        text = self.held.pop(r.rid, "") + r.detok.add(text_ids, final=r.finished is not None)
        stops = r.sampling.stop
        if stops:
            hits = [(pos, s) for s in stops if (pos := text.find(s)) != -1]
            if hits:
                pos, s = min(hits)
                text = text[:pos]
                r.finished = FinishReason("stop", matched=s)
        if r.finished is None:
            hold = held_stop_prefix(text, stops)
            if hold:
                self.held[r.rid], text = text[-hold:], text[:-hold]
            self._deliver(r, text, new_ids)
        else:  # a finished request is delivered once its memory is released
            self.held[r.rid], self.last_ids[r.rid] = text, new_ids

    def finish(self, r: Req, reason: FinishReason | None = None) -> None:
        """Deliver the final delta: whatever text is held (none after a stop string), and the finish reason."""
        if reason is not None:
            r.finished = reason
        text = self.held.pop(r.rid, "")
        if r.finished is not None and r.finished.type == "abort" and r.detok is not None:
            text += r.detok.add([], final=True)
        self._deliver(r, text, self.last_ids.pop(r.rid, []))

    def _deliver(self, r: Req, text: str, ids: list[int]) -> None:
        """Hand a delta to the request's consumer; a broken consumer must not take the batch down."""
        delta = {
            "rid": r.rid,
            "text_delta": text,
            "ids_delta": ids,
            "finished": r.finished is not None,
            "meta_info": self.meta_info(r),
        }
        if r.logprob is not None:
            delta["logprobs_delta"] = self.logprobs.pop(r.rid, [])
            delta["input_logprobs_delta"] = self.input_logprobs.pop(r.rid, [])
        try:
            r.sink(delta)
        except Exception:
            logger.exception("output consumer of %s failed; aborting that request", r.rid)
            if r.finished is None:
                r.finished = FinishReason("abort", message="output consumer failed")

    @staticmethod
    def meta_info(r: Req) -> dict[str, Any]:
        n = len(r.output_ids)
        return {
            "id": r.rid,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": n,
            "cached_tokens": r.cached_tokens or 0,
            "finish_reason": r.finished.to_dict() if r.finished else None,
            "e2e_latency": time.monotonic() - r.created,
            "spec_verify_ct": r.spec_verify_ct,
            "spec_accepted_tokens": r.spec_accepted_drafts,
            "spec_accept_length": (n - 1) / r.spec_verify_ct if r.spec_verify_ct else 0.0,
        }
