"""Streaming output on the real SmolLM2 tokenizer: a 4,000-token output with multi-byte characters arrives whole,
in order, without a broken character, and costs decode work in proportion to its new tokens; stop strings that
span token boundaries end the text exactly where they start and are never streamed."""

from __future__ import annotations

import random
from typing import Any

import pytest

from treepage.core import FinishReason, LogprobParams, Req, SamplingParams, StepOutput, TokenLogprob
from treepage.entrypoints.engine import CumulativeOutput
from treepage.managers.detokenizer import held_stop_prefix
from treepage.managers.output import OutputProcessor
from treepage.managers.tokenizer import load_tokenizer

PIECES = [
    "Grüße aus Köln, ",
    "日本語のテキスト、",
    "emoji 🙂🚀 and ",
    "naïve café — ",
    "price: 5 €; ",
    "Ελληνικά κείμενα. ",
    "plain ASCII words follow here. ",
]
MARK = "Zürich→東京 🧪 fin."  # appears once, about 3/4 into the output: the stop strings are cut from it


class CountingTokenizer:
    """The real tokenizer, counting how many ids each decode call is given."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.ids_decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.ids_decoded += len(ids)
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf_path: str) -> Any:
    return load_tokenizer(smollm2_gguf_path)


@pytest.fixture(scope="module")
def long_ids(tokenizer: Any) -> list[int]:
    rng = random.Random(0)
    pieces = [rng.choice(PIECES) for _ in range(1200)]
    pieces.insert(220, MARK)
    ids = tokenizer.encode("".join(pieces), add_special_tokens=False)[:4000]
    assert len(ids) == 4000
    return list(ids)


def stream(tokenizer: Any, ids: list[int], sp: SamplingParams, seed: int = 1) -> tuple[list[str], dict]:
    """Feed `ids` in steps of 1..6 tokens (the sizes of speculative rounds); return the text deltas and the final
    cumulative snapshot."""
    deltas: list[dict] = []
    out = OutputProcessor(tokenizer, eos_ids={0}, context_len=1 << 20, on_tokens=lambda n: None)
    req = Req("r", [1, 2, 3], sp, deltas.append)
    rng = random.Random(seed)
    i = 0
    while i < len(ids) and req.finished is None:
        n = rng.randint(1, 6)
        out.append(req, StepOutput(ids[i : i + n], 0, verified=True))
        i += n
    if req.finished is None:
        req.finished = FinishReason("length", matched=len(req.output_ids))
    out.finish(req)
    acc = CumulativeOutput()
    for d in deltas:
        acc.add(d)
    assert acc.finished and acc.output_ids == req.output_ids
    return [d["text_delta"] for d in deltas], acc.snapshot()


def test_long_output_streams_exactly_and_incrementally(tokenizer: Any, long_ids: list[int]) -> None:
    counting = CountingTokenizer(tokenizer)
    sp = SamplingParams(max_new_tokens=len(long_ids), ignore_eos=True)
    deltas, final = stream(counting, long_ids, sp)
    assert final["text"] == tokenizer.decode(long_ids)
    assert "".join(deltas) == final["text"]
    assert not any("\ufffd" in d for d in deltas)  # never half a character
    assert sum(1 for d in deltas if d) > 500  # it streams, it does not wait for the end
    # Incremental: each id is decoded a small constant number of times (re-decoding the whole output each
    # step would be about 4000 * 1300 / 2 ids here).
    assert counting.ids_decoded < 12 * len(long_ids), counting.ids_decoded


@pytest.mark.parametrize("stop", ["ich→東", "京 🧪", "🧪 fin", MARK])
def test_stop_string_across_token_boundaries(tokenizer: Any, long_ids: list[int], stop: str) -> None:
    full = tokenizer.decode(long_ids)
    pos = full.find(stop)
    assert pos > len(full) // 2
    sp = SamplingParams(max_new_tokens=len(long_ids), ignore_eos=True, stop=[stop, "never appears ±"])
    deltas, final = stream(tokenizer, long_ids, sp, seed=7)
    assert final["text"] == full[:pos]
    assert "".join(deltas) == full[:pos]  # nothing past the stop was ever streamed
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(final["output_ids"]) < len(long_ids)


def test_eos_token_ends_the_text_but_not_the_ids(tokenizer: Any, long_ids: list[int]) -> None:
    eos = 0
    ids = long_ids[:50] + [eos] + long_ids[50:60]
    _, final = stream(tokenizer, ids, SamplingParams(max_new_tokens=100))
    assert final["output_ids"] == long_ids[:50] + [eos]
    assert final["text"] == tokenizer.decode(long_ids[:50])
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert final["meta_info"]["spec_verify_ct"] > 0


def test_held_stop_prefix() -> None:
    assert held_stop_prefix("hello wor", ["world"]) == len("wor")
    assert held_stop_prefix("hello", ["xyz"]) == 0
    assert held_stop_prefix("abab", ["bab!", "b"]) == 3  # the longest held tail wins: "bab"
    assert held_stop_prefix("", ["ab"]) == 0


def test_prompt_logprobs_are_delivered_once_per_position(tokenizer: Any) -> None:
    """Chunks hand their prompt entries over before the first token; a prefill that runs again (after a
    retraction) repeats positions, which are dropped; output entries follow the ids, cut where the request stops."""
    deltas: list[dict] = []
    req = Req("r", list(range(10, 20)), SamplingParams(max_new_tokens=2, ignore_eos=True), deltas.append)
    req.logprob = LogprobParams(start=2)
    out = OutputProcessor(tokenizer, set(), 10_000, lambda n: None)

    def entries(first: int, last: int) -> list[TokenLogprob]:
        return [TokenLogprob(10 + p, -float(p)) for p in range(first, last)]

    out.append(req, StepOutput([], 6, input_logprobs=entries(2, 6), input_logprobs_start=2))  # chunk [0, 6)
    out.append(req, StepOutput([], 8, input_logprobs=entries(0, 8), input_logprobs_start=0))  # run again from 0
    assert deltas == [] and req.input_logprobs_len == 6
    first = [TokenLogprob(7, -0.5)]
    out.append(req, StepOutput([7], 10, logprobs=first, input_logprobs=entries(8, 10), input_logprobs_start=8))
    out.append(req, StepOutput([8, 9], 12, logprobs=[TokenLogprob(8, -1.0), TokenLogprob(9, -2.0)]))
    out.finish(req)
    acc = CumulativeOutput()
    for d in deltas:
        acc.add(d)
    assert [e.token for e in acc.input_logprobs] == list(range(12, 20))
    assert [e.logprob for e in acc.input_logprobs] == [-float(p) for p in range(2, 10)]
    assert acc.output_ids == [7, 8] and [e.logprob for e in acc.output_logprobs] == [-0.5, -1.0]
