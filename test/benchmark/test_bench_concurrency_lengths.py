"""benchmark/bench_concurrency.py --length-spread: every server gets the same requests with the same lengths, spread
around --max-tokens as asked (fixed lengths keep plain decoding's streams in step; spread ones do not)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))

import bench_concurrency  # noqa: E402
import pytest  # noqa: E402


def test_no_spread_is_every_request_at_max_tokens():
    assert bench_concurrency.output_lengths(17, 64, 0.0) == [64] * 17
    assert bench_concurrency.lengths_line(64, 0.0) == "64 tokens per request"


def test_spread_lengths_are_seeded_bounded_and_varied():
    lengths = bench_concurrency.output_lengths(400, 64, 0.5)
    assert lengths == bench_concurrency.output_lengths(400, 64, 0.5)  # the same for every server and pass
    assert lengths != bench_concurrency.output_lengths(400, 64, 0.5, seed=1)
    assert min(lengths) >= 32 and max(lengths) <= 96
    assert min(lengths) <= 34 and max(lengths) >= 94  # the whole range is drawn, not a narrow band
    assert 60 <= sum(lengths) / len(lengths) <= 68  # the mean stays --max-tokens: comparable work to fixed runs
    assert bench_concurrency.lengths_line(64, 0.5) == "32-96 tokens per request (uniform)"


@pytest.mark.parametrize("spread", [-0.1, 1.0, 1.5])
def test_spread_out_of_range_is_refused(spread):
    with pytest.raises(ValueError, match="--length-spread"):
        bench_concurrency.output_lengths(4, 64, spread)
