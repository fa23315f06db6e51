"""benchmark/bench_concurrency.py --control: a second default server, started after every other one, so a run
shows what the start position alone costs (docs/benchmarks_adaptive.md "Run 27"); the best of the others never
counts either default server."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))

import bench_concurrency as bc  # noqa: E402


def test_the_control_is_the_default_server_started_last():
    names = list(bc.servers())
    assert names[0] == bc.DEFAULT and names[-1] == bc.CONTROL
    assert bc.servers()[bc.CONTROL] == bc.servers()[bc.DEFAULT] == []  # the same launch flags
    assert bc.CONTROL not in bc.servers(control=False)


def test_best_is_taken_over_the_other_servers_only():
    def level(total: float, per_pass: list[float]) -> dict:
        return {"tok_per_s": total, "tok_per_s_per_pass": per_pass}

    run = {
        bc.DEFAULT: level(80.0, [70.0, 90.0]),
        "off": level(90.0, [100.0, 80.0]),
        "fixed 3x2x6": level(95.0, [90.0, 100.0]),
        bc.CONTROL: level(120.0, [110.0, 130.0]),  # faster than everything, and still never the best
    }
    first = bc.versus_best(run)
    assert first["best"] == "fixed 3x2x6" and first["ratio"] == round(80 / 95, 3)
    assert first["ratio_per_pass"] == [round(70 / 100, 3), round(90 / 100, 3)]  # per pass, the best of that pass
    last = bc.versus_best(run, bc.CONTROL)
    assert last["best"] == "fixed 3x2x6" and last["ratio"] == round(120 / 95, 3)
    run[bc.ADAPTIVE[bc.DEFAULT]] = first  # a level's entry also holds the comparisons: never read as servers
    assert bc.versus_best(run, bc.CONTROL) == last


def test_pass_order_never_runs_a_server_twice_in_a_row():
    """Each pass rotates the order by one: across the turn from one pass to the next no server runs twice in a row
    (the reversed order did that to the default and the control), and over len(names) passes every server takes
    every position once."""
    names = list(bc.servers())
    passes = [bc.pass_order(names, i) for i in range(3 * len(names))]
    assert all(sorted(p) == sorted(names) for p in passes)
    timeline = [name for p in passes for name in p]
    assert all(a != b for a, b in zip(timeline, timeline[1:]))
    for name in names:
        assert sorted(p.index(name) for p in passes[: len(names)]) == list(range(len(names)))
    assert bc.pass_order(names, 0) == names


def test_policy_state_keeps_the_estimates_and_the_level_s_batch_sizes():
    """Each pass records what the default's policy believed (why it served what it served), with the expected
    round times at the batch sizes the level runs only."""
    snapshot = {
        "current": "3x2x6",
        "one_draft_excess": 0.47,
        "excess_ratio": {"3x2x6": 2.2},
        "accept_estimate": {"3x2x6": 2.03, "off": 1.0},
        "host_speed_factor": 1.1,
        "served_seconds": {"3x2x6": {"1": 0.045, "2": 0.05, "8": 0.09}, "off": {"16": 0.05}},
        "calibration": {"round_seconds": {}},
        "rounds": {"3x2x6": 10},
    }
    state = bc.policy_state(snapshot, 2)
    assert set(state) == {*bc.POLICY_STATE_KEYS, "served_seconds"}
    assert state["served_seconds"] == {"3x2x6": {"1": 0.045, "2": 0.05}, "off": {}}
    assert state["host_speed_factor"] == 1.1 and state["current"] == "3x2x6"
