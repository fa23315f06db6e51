"""Adaptive speculation end to end on a tiny model: start-up calibration (bounded, cached, pinnable), the policy
driving real rounds with exact greedy output, and what /get_server_info reports."""

from __future__ import annotations

import json
import time

import pytest

from spec_utils import make_eagle_head, make_sharp_target
from treepage.entrypoints.engine import Engine
from treepage.server_args import ServerArgs

SP = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
PROMPTS = [[5 + (i * 7 + j) % 100 for j in range(10 + 9 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive_engine")
    target = make_sharp_target(str(root / "target"))
    return target, make_eagle_head(target, str(root / "eagle3"), "EAGLE3")


def adaptive_engine(ckpts, version: int, **kw) -> Engine:
    target, head = ckpts
    return Engine(
        ServerArgs(
            model_path=target,
            dtype="float32",
            page_size=16,
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=head,
            speculative_num_steps=4,
            speculative_eagle_topk=4,
            speculative_num_draft_tokens=16,
            speculative_adaptive=True,
            disable_overlap_schedule=version == 1,
            **kw,
        )
    )


@pytest.mark.parametrize("version", [1, 2])
def test_calibrates_caches_and_stays_exact(ckpts, tmp_path, monkeypatch, version):
    monkeypatch.setenv("TREEPAGE_STRICT_MEM_CHECK", "1")
    monkeypatch.setenv("TREEPAGE_CACHE_DIR", str(tmp_path / "cache"))
    plain = Engine(ServerArgs(model_path=ckpts[0], dtype="float32", page_size=1))
    try:
        ref = [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=SP)]
    finally:
        plain.shutdown()
    t0 = time.perf_counter()
    eng = adaptive_engine(ckpts, version)
    try:
        assert time.perf_counter() - t0 < 60
        info = eng.get_server_info()["speculative_adaptive"]
        assert info["policy"] == "adaptive"
        labels = ["4x4x16", "3x2x6", "3x1x4", "1x1x2", "off"]
        assert info["candidates"] == labels
        table = info["calibration"]["round_seconds"]
        assert set(table) == set(labels) and all(len(table[s]) >= 2 for s in labels), table
        assert all("1" in table[s] and max(map(int, table[s])) >= 4 for s in labels), table  # the range first
        assert all(t > 0 for s in labels for t in table[s].values())
        assert eng.memory_report()["used_pages"] == 0  # calibration returned every page and row
        cached = list((tmp_path / "cache" / "adaptive").glob("*.json"))
        assert len(cached) == 1
        out = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=SP)]
        assert out == ref
        single = eng.generate(input_ids=PROMPTS[0], sampling_params=SP)
        assert single["output_ids"] == ref[0]
        info = eng.get_server_info()["speculative_adaptive"]
        assert sum(info["rounds"].values()) > 0
        assert set(info["accept_estimate"]) == set(labels)
        extend = info["draft_extend_seconds"]  # the draft's prefill extends were timed for the catch-up's price
        assert extend is not None and extend["fixed"] + 100 * extend["per_token"] > 0, extend
        # the smaller shapes also learn from the greedy rounds of the bigger ones (subtree_accept_len)
        for label in ("3x2x6", "3x1x4", "1x1x2"):
            assert info["accept_rounds"][label] > info["rounds"][label], label
        eng.wait_idle()
        assert eng.memory_report()["used_pages"] == 0
    finally:
        eng.shutdown()


def test_pinned_table_is_loaded_not_measured(ckpts, tmp_path):
    """A pinned file that exists is used as is: here it says OFF is far faster, so every round is plain."""
    labels = ["4x4x16", "3x2x6", "3x1x4", "1x1x2", "off"]
    seconds = {s: {"1": 1.0, "8": 8.0} for s in labels}
    seconds["off"] = {"1": 0.001, "8": 0.002}
    path = tmp_path / "pinned.json"
    path.write_text(
        json.dumps({"key": {}, "round_seconds": seconds, "prior_accept": dict.fromkeys(labels, 2.0)})
    )
    t0 = time.perf_counter()
    eng = adaptive_engine(ckpts, 2, speculative_adaptive_calibration=str(path))
    try:
        info = eng.get_server_info()["speculative_adaptive"]
        assert info["calibration"]["round_seconds"]["off"] == {"1": 0.001, "8": 0.002}
        eng.generate(input_ids=PROMPTS, sampling_params=SP)
        rounds = eng.get_server_info()["speculative_adaptive"]["rounds"]
        # after 4 exploration rounds per shape, only probes (every 32 rounds) leave OFF
        assert rounds["off"] > 0 and sum(rounds.values()) - rounds["off"] <= 4 * 4 + rounds["off"] // 32 + 1
    finally:
        eng.shutdown()
    assert time.perf_counter() - t0 < 60


def test_missing_pinned_table_is_measured_and_written(ckpts, tmp_path):
    path = tmp_path / "sub" / "table.json"
    eng = adaptive_engine(ckpts, 1, speculative_adaptive_calibration=str(path))
    try:
        assert path.exists()
        data = json.loads(path.read_text())
        assert "off" in data["round_seconds"] and data["key"]["dtype"] == "float32"
    finally:
        eng.shutdown()


def record_accept_rounds(monkeypatch) -> tuple[list[str], dict[str, float]]:
    """Spies on calibrate._measure_accept: the label of every round it serves, and the priors it returns."""
    import treepage.speculative.calibrate as calibrate

    served: list[str] = []
    measured: dict[str, float] = {}
    real = calibrate._measure_accept

    def spy(worker, shapes, prompts, deadline=None):
        run_round = worker.run_round

        def recording(reqs, allocated, shape):
            served.append(shape.label)
            return run_round(reqs, allocated, shape)

        worker.run_round = recording
        try:
            measured.update(real(worker, shapes, prompts, deadline))
        finally:
            del worker.run_round
        return dict(measured)

    monkeypatch.setattr(calibrate, "_measure_accept", spy)
    return served, measured


def test_accept_priors_are_paired_on_the_largest_shapes_rounds(ckpts, tmp_path, monkeypatch):
    """Calibration serves only the shapes no other contains and reads every contained shape (and the one-draft
    chain) off the same rounds, so a contained shape's prior never exceeds its container's."""
    import treepage.speculative.calibrate as calibrate

    monkeypatch.setenv("TREEPAGE_CACHE_DIR", str(tmp_path / "cache"))
    served, measured = record_accept_rounds(monkeypatch)
    eng = adaptive_engine(ckpts, 1)
    try:
        # every pass serves 4x4x16 once; the passes stop at the accept share of the budget, never before the minimum
        assert set(served) == {"4x4x16"}
        assert calibrate.MIN_ACCEPT_PASSES <= len(served) <= calibrate.ACCEPT_PASSES * 4
        prior = eng.get_server_info()["speculative_adaptive"]["calibration"]["prior_accept"]
        assert prior == pytest.approx(measured)
        assert prior["4x4x16"] >= prior["3x2x6"] >= prior["3x1x4"] >= prior["1x1x2"] >= 1.0 == prior["off"]
        assert prior["4x4x16"] > 1.0  # the sharp target accepts drafts: the test measures something
    finally:
        eng.shutdown()


def test_a_spent_budget_still_measures_batch_one_and_the_minimum_accept(ckpts, tmp_path, monkeypatch):
    """On a machine too slow for the budget the accept measurement stops at its share (after the minimum passes)
    and batch 1 is still timed, every larger batch skipped as predicted to overrun."""
    import treepage.speculative.calibrate as calibrate

    monkeypatch.setenv("TREEPAGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "CPU_BUDGET_S", 0.0)
    served, _ = record_accept_rounds(monkeypatch)
    eng = adaptive_engine(ckpts, 1)
    try:
        assert len(served) == calibrate.MIN_ACCEPT_PASSES
        table = eng.get_server_info()["speculative_adaptive"]["calibration"]["round_seconds"]
        assert all(list(v) == ["1"] for v in table.values()), table
        assert eng.generate(input_ids=PROMPTS[0], sampling_params=SP)["output_ids"]
    finally:
        eng.shutdown()


def test_budget_prediction_is_pessimistic_beyond_the_measured_range():
    from treepage.speculative.calibrate import _predicted_seconds

    assert _predicted_seconds({1: 0.1}, 16) == pytest.approx(1.6)  # one point: in proportion
    assert _predicted_seconds({1: 0.1, 4: 0.2}, 2) == pytest.approx(0.1 + 0.1 / 3)  # between: linear
    assert _predicted_seconds({1: 0.1, 4: 0.2}, 16) == pytest.approx(0.8)  # beyond: from the largest
    assert _predicted_seconds({4: 0.2}, 2) == pytest.approx(0.2)  # below the smallest: no cheaper than it
