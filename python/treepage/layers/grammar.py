"""Grammar-constrained decoding (json_schema, regex, ebnf, choice, structural_tag) with xgrammar, as a path-aware
RequestLogitsProcessor (layers/logits_processor.py; docs/design.md, "Logits processing").

A request's `GrammarProcessor` holds one xgrammar `GrammarMatcher` advanced by the emitted tokens. For R rows it
walks each row's path on top of that state (accept the path's tokens, fill the row's bitmask, roll back), visiting
the rows in lexicographic path order so a tree's common prefixes are accepted once; a row whose path the grammar
rejects can never be accepted by verification and gets a harmless stop-tokens-only row. Once the grammar has
accepted a stop token (it is complete and ended) only stop tokens are allowed, so a request with `ignore_eos`
emits stop tokens until `max_new_tokens`; a request cut short by `max_new_tokens` or a stop string simply ends
with an incomplete text, as in SGLang.

`GrammarCompiler` (one per engine, built lazily from the engine's tokenizer and the model's logits width, which
may exceed the tokenizer's vocabulary) compiles each request's constraint once and keeps compiled grammars in
xgrammar's cache; an invalid schema / regex / EBNF is a SamplingParamError naming its field (an HTTP 400).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from treepage.core import SamplingParamError, SamplingParams
from treepage.layers.logits_processor import RequestLogitsProcessor

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CACHE_LIMIT_BYTES = 512 << 20  # compiled grammars kept by xgrammar (JSON schemas of real APIs are a few MB each)
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: " error prefix


class GrammarTimer:
    """Wall time spent inside grammar processors (benchmark/bench_grammar.py reads it; a few perf_counter calls)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds

    def reset(self) -> None:
        with self._lock:
            self.seconds = 0.0


TIMER = GrammarTimer()


def _clean(exc: Exception) -> str:
    return _XGR_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


class GrammarCompiler:
    """One per engine: xgrammar's tokenizer info and compiler; compiled grammars are cached by xgrammar."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: Iterable[int]) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.stop_ids = sorted(set(stop_ids))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=CACHE_LIMIT_BYTES)

    def compile(self, field: str, value: Any) -> xgr.CompiledGrammar:
        """Raises SamplingParamError(field) when the constraint does not compile."""
        try:
            if field == "json_schema":
                if not isinstance(value, str):
                    raise SamplingParamError(field, "json_schema must be a JSON schema as a string")
                try:
                    json.loads(value)
                except ValueError as e:
                    raise SamplingParamError(field, f"json_schema is not valid JSON: {e}") from None
                return self.compiler.compile_json_schema(value, any_whitespace=False)
            if field == "regex":
                return self.compiler.compile_regex(_need_str(field, value))
            if field == "ebnf":
                return self.compiler.compile_grammar(_need_str(field, value))
            if field == "choice":
                if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                    raise SamplingParamError(field, "choice must be a non-empty list of non-empty strings")
                return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in value))
            if field == "structural_tag":
                return self.compiler.compile_structural_tag(_structural_tag(_need_str(field, value)))
        except SamplingParamError:
            raise
        except Exception as e:  # xgrammar reports every parse / conversion error as a RuntimeError
            raise SamplingParamError(field, f"invalid {field}: {_clean(e)}") from None
        raise ValueError(f"unknown grammar field {field!r}")

    def processor(self, sp: SamplingParams, stop_ids: Iterable[int]) -> GrammarProcessor | None:
        """The request's grammar processor (None when it has no constraint). `stop_ids`: the engine's EOS ids;
        the request's own stop_token_ids are added (either ends a complete grammar)."""
        given = sp.grammar
        if given is None:
            return None
        return GrammarProcessor(self.compile(*given), sp.stop_token_set(stop_ids, self.vocab_size), self.vocab_size)


def _need_str(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise SamplingParamError(field, f"{field} must be a non-empty string")
    return value


def _structural_tag(text: str) -> Any:
    """SGLang's form ({"structures": [{"begin", "schema", "end"}], "triggers"}) or xgrammar's ({"format"})."""
    import xgrammar as xgr

    try:
        tag = json.loads(text)
    except ValueError as e:
        raise SamplingParamError("structural_tag", f"structural_tag is not valid JSON: {e}") from None
    if isinstance(tag, dict) and "structures" in tag:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        return xgr.StructuralTag.from_legacy_structural_tag(items, list(tag.get("triggers", [])))
    return text


class GrammarProcessor(RequestLogitsProcessor):
    """Masks every token the grammar forbids after each row's history (accepted output + the row's path)."""

    constrains = True

    def __init__(self, compiled: xgr.CompiledGrammar, stop_ids: Iterable[int], vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.compiled = compiled
        self.stop_ids = sorted(set(stop_ids))
        self.vocab_size = vocab_size
        self.stop_row = xgr.allocate_token_bitmask(1, vocab_size)[0]
        self.stop_row.zero_()
        for t in self.stop_ids:
            self.stop_row[t // 32] |= _bit(t % 32)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.failed = False
        self.matcher = self._new_matcher()

    def _new_matcher(self) -> xgr.GrammarMatcher:
        return self._xgr.GrammarMatcher(self.compiled, override_stop_tokens=self.stop_ids or None)

    # ---- history -------------------------------------------------------------------------------------------------
    def accept(self, tokens: Sequence[int]) -> None:
        if self.failed:
            return
        for t in tokens:
            if self.matcher.is_terminated():
                ok = t in self.stop_ids  # ignore_eos: stop tokens after the end
            else:
                ok = self.matcher.accept_token(t)
            if not ok:
                # only when another processor masked every token the grammar allows (min_new_tokens past a
                # complete grammar): the request goes on unconstrained rather than with an all -inf row
                logger.warning("grammar rejected emitted token %d; the rest of the request is unconstrained", t)
                self.failed = True
                return

    def reset(self) -> None:
        self.matcher = self._new_matcher()
        self.failed = False

    # ---- rows ------------------------------------------------------------------------------------------------------
    def fill(self, paths: Sequence[Sequence[int]]) -> tuple[Tensor, list[int]]:
        """(bitmask [R, ceil(V / 32)] int32, rows whose path the grammar rejects). Rejected rows hold the
        stop tokens only; the matcher ends in the state it started from."""
        R = len(paths)
        if self.bitmask.shape[0] < R:
            self.bitmask = self._xgr.allocate_token_bitmask(R, self.vocab_size)
        bitmask = self.bitmask[:R]
        m = self.matcher
        cur: list[int] = []  # tokens on top of the history, as the matcher holds them now
        real: list[bool] = []  # per token of cur: accepted by the matcher (False: a stop token after the end)
        rejected: list[int] = []
        for i in sorted(range(R), key=lambda j: tuple(paths[j])):  # a path right after its prefixes
            p = paths[i]
            common = 0
            while common < len(cur) and common < len(p) and cur[common] == p[common]:
                common += 1
            self._pop(cur, real, len(cur) - common)
            ok = True
            for t in p[common:]:
                if m.is_terminated():
                    ok = t in self.stop_ids
                    if ok:
                        real.append(False)
                elif m.accept_token(t):
                    real.append(True)
                else:
                    ok = False
                if not ok:
                    break
                cur.append(t)
            if not ok:
                rejected.append(i)
                bitmask[i] = self.stop_row
            elif m.is_terminated():
                bitmask[i] = self.stop_row
            else:
                m.fill_next_token_bitmask(bitmask, i)
        self._pop(cur, real, len(cur))
        return bitmask, rejected

    def _pop(self, cur: list[int], real: list[bool], n: int) -> None:
        if n <= 0:
            return
        back = sum(real[-n:])
        if back:
            self.matcher.rollback(back)
        del cur[-n:], real[-n:]

    def apply(self, logits: Tensor, paths: Sequence[Sequence[int]]) -> None:
        if self.failed:
            return
        t0 = time.perf_counter()
        bitmask, _ = self.fill(paths)
        self._xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=logits.shape[1]
        )
        TIMER.add(time.perf_counter() - t0)

    def allowed(self, paths: Sequence[Sequence[int]]) -> Tensor | None:
        """[R, V] bool of the tokens each row may take (rejected rows: none), for pruning draft candidates."""
        if self.failed:
            return None
        t0 = time.perf_counter()
        bitmask, rejected = self.fill(paths)
        bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        out = bits.reshape(len(paths), -1)[:, : self.vocab_size].bool()
        if rejected:
            out[rejected] = False
        TIMER.add(time.perf_counter() - t0)
        return out


def _bit(j: int) -> int:
    """Bit j of an int32 word as a Python int in int32 range (bit 31 is the sign bit)."""
    return -(1 << 31) if j == 31 else 1 << j
