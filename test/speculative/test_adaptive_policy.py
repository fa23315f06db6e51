"""The adaptive policy and cost model on synthetic tables (no model runs): candidate derivation, interpolation,
the argmax of expected tokens/s, hysteresis, the online accept estimate, probes, config and cache files, and
the memory sizing over all candidates."""

from __future__ import annotations

import json
import logging
import math
import os
import random
from collections import Counter

import pytest

from treepage.arg_groups.speculative import apply_default_server_speculation, resolve_speculative
from treepage.mem_cache.sizing import (
    alloc_len_for_shape,
    get_alloc_len_per_decode,
    get_alloc_reserve_per_decode,
    get_row_width_extra,
    max_shape_desc,
)
from treepage.server_args import ArgumentError, ServerArgs
from treepage.speculative import adaptive
from treepage.speculative.adaptive import (
    OFF,
    AdaptiveConfig,
    AdaptivePolicy,
    CostTable,
    CyclePolicy,
    DraftExtendCost,
    TreeShape,
    check_shape,
    default_candidates,
    load_table,
    save_table,
    weights_fingerprint,
)

BIG, MID, CHAIN, ONE = TreeShape(4, 4, 16), TreeShape(3, 2, 6), TreeShape(3, 1, 4), TreeShape(1, 1, 2)


def test_default_candidates_derive_downwards():
    assert default_candidates(BIG) == [BIG, MID, CHAIN, ONE]
    assert default_candidates(TreeShape(4, 8, 16)) == [
        TreeShape(4, 8, 16),
        TreeShape(3, 4, 12),
        TreeShape(3, 2, 6),
        CHAIN,
        ONE,
    ]
    assert default_candidates(CHAIN) == [CHAIN, TreeShape(2, 1, 3), ONE]
    assert default_candidates(ONE) == [ONE]
    for c in default_candidates(TreeShape(5, 8, 32)):
        assert check_shape(c) is None, c
    assert OFF.is_off and OFF.label == "off" and TreeShape.parse("3x2x6") == MID


# Seconds per round: the tree's verify grows fast with the batch, plain decode barely.
SECONDS = {
    BIG.label: {1: 0.100, 2: 0.140, 4: 0.220, 8: 0.380},
    MID.label: {1: 0.070, 2: 0.090, 4: 0.130, 8: 0.210},
    CHAIN.label: {1: 0.060, 2: 0.075, 4: 0.105, 8: 0.165},
    ONE.label: {1: 0.045, 2: 0.052, 4: 0.066, 8: 0.094},
    "off": {1: 0.030, 2: 0.033, 4: 0.039, 8: 0.051},
}
PRIOR = {BIG.label: 3.2, MID.label: 2.4, CHAIN.label: 2.2, ONE.label: 1.6, "off": 1.0}


def table() -> CostTable:
    return CostTable({k: dict(v) for k, v in SECONDS.items()}, dict(PRIOR))


def policy(**kw) -> AdaptivePolicy:
    kw.setdefault("probe_every", 0)
    kw.setdefault("explore_rounds", 0)
    return AdaptivePolicy(AdaptiveConfig([BIG, MID, CHAIN, ONE], **kw), table())


def brute_best(accept: dict[str, float], batch: int) -> str:
    t = table()
    return max(accept, key=lambda s: accept[s] * batch / t.seconds(TreeShape.parse(s), batch))


def test_interpolation_and_extrapolation():
    t = table()
    assert t.seconds(BIG, 1) == pytest.approx(0.100)
    assert t.seconds(BIG, 3) == pytest.approx(0.180)  # halfway between 2 and 4
    assert t.seconds(BIG, 16) == pytest.approx(0.380 + 8 * (0.380 - 0.220) / 4)  # last segment's slope
    # A noisy flat last segment: beyond the range the slope of all points, not zero.
    noisy = CostTable({"off": {1: 0.1, 2: 0.2, 4: 0.2}}, {"off": 1.0})
    assert noisy.seconds(OFF, 8) == pytest.approx(0.2 + 4 * (0.4 / 3) / (14 / 3))
    single = CostTable({"off": {2: 0.04}}, {"off": 1.0})
    assert single.seconds(OFF, 4) == pytest.approx(0.08)


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 8, 16])
def test_picks_the_argmax_of_expected_tokens_per_second(batch):
    p = policy(hysteresis=0.0)
    assert p.choose(batch).label == brute_best(PRIOR, batch)


def test_the_right_shape_per_batch_size():
    """With an accept estimate of 4 the big tree makes 40 tok/s at batch 1 (off: 33.3) and 84 at batch 8, where
    off makes 157: the tree at batch 1, plain decoding at batch 8."""
    p = policy(hysteresis=0.0)
    p.accept[BIG] = 4.0  # 40 tok/s at batch 1 vs off 33.3
    assert p.choose(1) == BIG
    assert p.choose(8) == OFF  # off: 8 / 0.051 = 157 tok/s; big: 32 / 0.380 = 84
    assert brute_best({s.label: a for s, a in p.accept.items()}, 8) == "off"


def test_hysteresis_holds_and_releases():
    p = policy(hysteresis=0.10)
    p.current = ONE
    # At batch 4: ONE = 1.6*4/0.066 = 97.0 tok/s, off = 4/0.039 = 102.6 tok/s: off is better by 5.8% < 10%.
    assert p.rate(OFF, 4) > p.rate(ONE, 4)
    assert p.choose(4) == ONE
    # At batch 8 off is better by 157/136 = 15%: the policy switches.
    assert p.choose(8) == OFF
    # and does not flap back at batch 4, where ONE is not better than off
    for _ in range(10):
        assert p.choose(4) == OFF
    assert p.rounds["off"] == 11 and p.rounds[ONE.label] == 1


def set_rate(p: AdaptivePolicy, shape: TreeShape, rate: float, batch: int = 4) -> None:
    """Set the shape's accept estimate so that its expected rate at this batch size is `rate`."""
    p.accept[shape] = rate * p.seconds(shape, batch) / batch


def test_a_narrow_margin_between_speculative_shapes_and_a_wide_one_around_off():
    """A switch between two speculative shapes costs nothing, so 3 % is enough to make it (`shape_hysteresis`,
    1 %); a switch to OFF (and back, over a catch-up) needs the wide margin (`hysteresis`, 5 %)."""

    def case(**kw) -> AdaptivePolicy:
        p = policy(**kw)
        off = p.rate(OFF, 4)
        for shape in (BIG, MID):
            set_rate(p, shape, 0.5 * off)
        set_rate(p, CHAIN, 1.2 * off)
        set_rate(p, ONE, 1.2 * 1.03 * off)  # 3 % ahead of CHAIN
        p.current = CHAIN
        return p

    p = case()
    assert p.choose(4) == ONE
    assert case(shape_hysteresis=0.05).choose(4) == CHAIN
    # OFF 3 % ahead of the current shape: no switch
    p = case()
    set_rate(p, CHAIN, 0.5 * p.rate(OFF, 4))
    set_rate(p, ONE, p.rate(OFF, 4) / 1.03)
    p.current = ONE
    assert p.choose(4) == ONE
    assert case(hysteresis=0.01).choose(4) == ONE  # (the speculative switch above, unchanged)
    p.config.hysteresis = 0.01
    assert p.choose(4) == OFF


def test_a_slow_stretch_of_the_host_moves_every_shape():
    """MID serves, 3 % ahead of CHAIN; then the host slows every round by 30 % (another process on the cores).
    Taken as MID's own, it would make CHAIN, whose estimate no round refreshes, look 25 % faster than MID; taken as
    the host's (HOST_EMA), both move and MID keeps serving. When the host recovers, so do both."""
    p = policy()
    for shape in (BIG, ONE):
        p.accept[shape] = 1.0
    true = {MID: p.seconds(MID, 4), CHAIN: p.seconds(CHAIN, 4)}
    set_rate(p, CHAIN, 1.5 * p.rate(OFF, 4))  # well ahead of OFF
    set_rate(p, MID, 1.03 * p.rate(CHAIN, 4))  # 3 % ahead of CHAIN
    p.current = MID

    def serve(rounds: int, host: float) -> list[TreeShape]:
        picks = []
        for _ in range(rounds):
            picks.append(p.choose(4))
            p.observe(picks[-1], [], 4, host * true[picks[-1]])
            assert p.current == MID
        return picks

    # MID's time at batch 4 becomes known (the host's factor learns from its rounds from then on); CHAIN runs
    # twice as a close contender at a new load level
    assert serve(20, 1.0).count(CHAIN) == 2
    assert serve(40, 1.3) == [MID] * 40
    assert p.seconds(MID, 4) == pytest.approx(1.3 * true[MID], rel=0.03)
    assert p.seconds(CHAIN, 4) / true[CHAIN] > 1.2  # the host's factor carries the slow stretch to CHAIN too
    assert serve(40, 1.0) == [MID] * 40
    assert p.seconds(CHAIN, 4) == pytest.approx(true[CHAIN], rel=0.03)


def test_accept_estimate_moves_the_choice():
    """E[accept] = 1 + rho * h: a greedy round moves h (the one-draft excess, prior 0.6) and the ratio of every
    shape it knows (here MID and what MID contains); BIG, not known this round, moves with h alone."""
    p = policy(hysteresis=0.05, prior_rounds=8.0)
    p.observe(MID, [1, 2], 2, SECONDS[MID.label][2], {MID: [1, 2], CHAIN: [1, 2], ONE: [1, 2]})
    w = 2 / 10  # its two requests weigh 2/10 against the prior's 8 request-rounds, in the ratios and in h
    h = (1 - w) * 0.6 + w * 0.5
    assert p.hit == pytest.approx(h)
    rho_mid = ((1 - w) * 1.4 + w * 0.5) / ((1 - w) * 0.6 + w * 0.5)
    assert p.accept[MID] == pytest.approx(1 + rho_mid * h)
    assert p.accept[BIG] == pytest.approx(1 + 2.2 / 0.6 * h)  # its calibrated ratio, today's traffic
    p.accept[BIG] = 4.0
    assert p.choose(1) == BIG
    # the traffic turns out unpredictable: one token per round (sampled: no counterfactual)
    for _ in range(240):  # 480 request-rounds: h's EMA (hit_ema per request) has forgotten the easy start
        p.observe(BIG, [1, 1], 2, SECONDS[BIG.label][2])
    assert p.accept[BIG] < 1.1
    assert p.choose(1) != BIG
    p.observe(OFF, [], 1, SECONDS["off"][1])  # OFF emits one token per round, always
    assert p.accept[OFF] == 1.0
    assert p.seconds(BIG, 3) == pytest.approx(table().seconds(BIG, 3))  # rounds as calibrated: no correction


def test_served_round_times_correct_the_calibration():
    """Calibration said OFF takes 51 ms at batch 8; served OFF rounds take 204 ms (say the calibration ran while
    another process slept). The served rounds take over from the calibration, and the policy switches to a
    speculative shape."""
    p = policy(hysteresis=0.05)
    assert p.choose(8) == OFF
    for _ in range(20):
        p.observe(OFF, [], 8, 0.204)
    assert p.seconds(OFF, 8) == pytest.approx(0.204, rel=0.2)
    # Other batch sizes of the same shape scale the table by what served rounds took.
    assert p.seconds(OFF, 1) == pytest.approx(SECONDS["off"][1] * 4, rel=0.2)
    best = p.choose(8)
    assert best == ONE == max(p.candidates, key=lambda c: p.rate(c, 8))
    assert p.log_host > 0.1  # OFF's settled rounds stayed slow: part of it is taken as the host's
    slow = p.seconds(BIG, 1)
    p.observe(BIG, [3, 3], 2, 10 * SECONDS[BIG.label][2])  # one outlier moves the log-space estimate by 1/3
    # of its surprise against what BIG was expected to take on this host
    assert p.seconds(BIG, 1) == pytest.approx(slow * (10 / math.exp(p.log_host)) ** (1 / 3))


def test_probes_refresh_other_shapes():
    p = policy(probe_every=4, probe_budget=100.0, hysteresis=0.0)
    chosen = [p.choose(8) for _ in range(12)]
    assert chosen.count(OFF) == 9
    assert all(not c.is_off for c in chosen[3::4])  # every fourth round runs the best speculative shape


def test_cycle_policy_visits_every_shape_and_off():
    c = CyclePolicy([BIG, MID, CHAIN, ONE])
    seen = [c.choose(1) for _ in range(10)]
    assert seen[:5] == [BIG, MID, CHAIN, ONE, OFF] and seen[5:] == seen[:5]
    assert all(a != b for a, b in zip(seen, seen[1:]))  # a change every round


def test_config_file(tmp_path):
    path = tmp_path / "adaptive.json"
    path.write_text(
        json.dumps(
            {"candidates": [[3, 1, 4], [1, 1, 2]], "hysteresis": 0.2, "include_off": False, "ratio_ema": 0.01}
        )
    )
    cfg = AdaptiveConfig.load(str(path), BIG)
    assert cfg.candidates == [CHAIN, ONE] and cfg.hysteresis == 0.2 and cfg.include_off is False
    assert cfg.ratio_ema == 0.01
    path.write_text(json.dumps({"candidates": [[3, 1, 9]]}))
    with pytest.raises(ValueError, match="chain"):
        AdaptiveConfig.load(str(path), BIG)
    path.write_text(json.dumps({"candidate": []}))
    with pytest.raises(ValueError, match="unknown keys"):
        AdaptiveConfig.load(str(path), BIG)


def test_cache_round_trip_and_key(tmp_path):
    t = table()
    t.key = {"model": "m", "device": "cpu"}
    path = tmp_path / "t.json"
    save_table(path, t)
    back = load_table(path, t.key)
    assert back is not None and back.round_seconds == t.round_seconds and back.prior_accept == t.prior_accept
    assert load_table(path, {"model": "other", "device": "cpu"}) is None
    assert load_table(path, None) is not None  # a pinned file is trusted
    assert load_table(tmp_path / "missing.json", None) is None


def test_sizing_takes_the_max_over_candidates():
    args = ServerArgs(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path="d",
        page_size=64,
        speculative_num_steps=4,
        speculative_eagle_topk=4,
        speculative_num_draft_tokens=16,
        speculative_adaptive=True,
    )
    resolve_speculative(args)
    assert args.speculative_shapes == [(4, 4, 16), (3, 2, 6), (3, 1, 4), (1, 1, 2)]
    alloc = get_alloc_len_per_decode(args)
    assert alloc == max(alloc_len_for_shape(64, k, s, n) for s, k, n in args.speculative_shapes) == 512
    assert get_alloc_reserve_per_decode(args) == 1024
    assert get_row_width_extra(args) == 2 * 512 + 63
    assert max_shape_desc(args) == (4, 4, 16)
    # A config whose candidates exceed the configured shape widens the rows for them.
    args.speculative_shapes = [(4, 4, 16), (5, 8, 32)]
    assert get_alloc_len_per_decode(args) == alloc_len_for_shape(64, 8, 5, 32) == 1024


def test_routing_default_server_adapts_explicit_flags_do_not():
    a = ServerArgs(model_path="m")
    apply_default_server_speculation(a)
    assert a.speculative_adaptive is True
    resolve_speculative(a)
    assert a.speculative_adaptive is True and len(a.speculative_shapes) == 4
    fixed = ServerArgs(model_path="m", speculative_num_steps=3, speculative_eagle_topk=1)
    apply_default_server_speculation(fixed)
    resolve_speculative(fixed)
    assert fixed.speculative_adaptive is False and fixed.speculative_shapes == [(3, 1, 4)]
    off = ServerArgs(model_path="m", speculative_algorithm="NONE")
    apply_default_server_speculation(off)
    resolve_speculative(off)
    assert not off.speculative_adaptive
    with pytest.raises(ArgumentError, match="--speculative-adaptive"):
        resolve_speculative(ServerArgs(speculative_adaptive=True))
    with pytest.raises(ArgumentError, match="need --speculative-adaptive"):
        resolve_speculative(
            ServerArgs(
                speculative_algorithm="EAGLE",
                speculative_draft_model_path="d",
                speculative_adaptive_config="x",
            )
        )


def test_a_shape_change_is_logged(caplog):
    p = policy(hysteresis=0.0)
    p.accept[BIG] = 4.0
    with caplog.at_level(logging.INFO, logger="treepage.speculative.adaptive"):
        p.choose(1)
        p.choose(1)
        p.choose(8)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"speculative shape {BIG.label} -> off at batch 8 (expected 156.9 vs 84.2 tok/s)"]


def test_probes_time_off_while_speculating():
    """While a tree wins, OFF is the runner-up that gets probed: its served time is learnt too."""
    p = policy(probe_every=4, probe_budget=100.0, hysteresis=0.0)
    p.accept[BIG] = 6.0  # the big tree wins at batch 1 by far; OFF (33.3 tok/s) is the runner-up
    chosen = [p.choose(1) for _ in range(8)]
    assert chosen[3] == max((c for c in p.candidates if c != BIG), key=lambda c: p.rate(c, 1))
    assert chosen.count(BIG) == 6
    p.observe(OFF, [], 1, 0.3)
    assert p.snapshot()["served_seconds"]["off"][1] == pytest.approx(
        math.exp((2 * math.log(0.03) + math.log(0.3)) / 3), rel=1e-3
    )


def test_probes_alternate_the_runner_up_and_the_longest_unserved():
    """Every other probe runs the runner-up; the rest visit the lower-ranked candidates within the probe margin
    in turn, so a shape whose estimate came out low is measured again instead of never."""
    p = policy(probe_every=2, probe_budget=100.0, hysteresis=0.0, probe_margin=0.0)
    p.accept[BIG] = 6.0
    ranked = sorted((c for c in p.candidates if c != BIG), key=lambda c: -p.rate(c, 1))
    probes = [p.choose(1) for _ in range(16)][1::2]  # rounds 2, 4, ...: the probes
    assert probes[0::2] == [ranked[0]] * 4  # the runner-up every other probe
    assert sorted(probes[1::2][:3], key=ranked.index) == ranked[1:]  # each of the others once, in turn
    assert probes[1::2][3] == probes[1::2][0]  # then around again


def test_periodic_probes_skip_shapes_far_below_the_chosen_one():
    """A lower-ranked shape whose estimate is below probe_margin of the chosen shape's is not worth a round."""
    p = policy(probe_every=2, probe_budget=100.0, hysteresis=0.0, probe_margin=0.7)
    p.accept[BIG], p.accept[MID] = 4.0, 1.0  # MID far below, the rest close
    best = p.rate(BIG, 1)
    ranked = sorted((c for c in p.candidates if c != BIG), key=lambda c: -p.rate(c, 1))
    close = [c for c in ranked[1:] if p.rate(c, 1) >= 0.7 * best]
    assert MID not in close and len(close) >= 2  # the setting the test needs
    probes = [p.choose(1) for _ in range(16)][1::2]
    assert set(probes) == {ranked[0], *close}


def test_start_up_exploration_serves_every_candidate():
    p = policy(explore_rounds=2, hysteresis=0.0)
    first = [p.choose(1) for _ in range(10)]
    assert sorted(first) == sorted([BIG, MID, CHAIN, ONE, OFF] * 2)
    assert p.choose(1) == max(p.candidates, key=lambda c: p.rate(c, 1))  # then the policy decides


def test_served_time_at_the_nearest_batch_size_carries_over():
    """Served rounds at batch 8 inform batch 7 (by the table's ratio between the two), before any round at 7."""
    p = policy()
    for _ in range(10):
        p.observe(OFF, [], 8, 0.204)
    t = table()
    assert p.seconds(OFF, 7) == pytest.approx(p.seconds(OFF, 8) * t.seconds(OFF, 7) / t.seconds(OFF, 8))
    p.observe(OFF, [], 2, 0.050)  # now batch 2 is the nearest served size for batch 3 (ratio 1.5 vs 2.67)
    assert p.seconds(OFF, 3) == pytest.approx(p.seconds(OFF, 2) * t.seconds(OFF, 3) / t.seconds(OFF, 2))


def test_a_new_load_level_probes_its_close_contenders_once():
    """The load rises to batch 8, where the calibration (which stopped at batch 4) extrapolates OFF too slow and
    MID looks best. After MID's first served round there, OFF (within the probe margin) runs once; its served
    time shows it is faster and the policy switches at once, not 32 rounds later. A contender far below the
    margin (BIG) is never probed."""
    slow_off = {k: dict(v) for k, v in SECONDS.items()}
    slow_off["off"] = {1: 0.030, 2: 0.050, 4: 0.100}  # calibration disturbed: OFF looks expensive at batch 8
    p = AdaptivePolicy(
        AdaptiveConfig([BIG, MID], probe_every=0, explore_rounds=0, hysteresis=0.05),
        CostTable(slow_off, {**PRIOR, MID.label: 2.0, BIG.label: 1.5}),
    )
    p.current = MID
    assert p.choose(8) == MID  # no round served at this load yet: the chosen shape runs first
    for _ in range(20):  # MID's served time at batch 8 has converged to 0.312 s: 51 tok/s
        p.observe(MID, [2] * 8, 8, 0.312)
    rival = max((c for c in p.candidates if c != MID), key=lambda c: p.rate(c, 8))
    assert rival == OFF and p.rate(OFF, 8) >= 0.7 * p.rate(MID, 8)
    assert p.rate(BIG, 8) < 0.7 * p.rate(MID, 8)
    assert p.choose(8) == OFF  # the probe, two rounds
    p.observe(OFF, [], 8, 0.127)
    assert p.choose(8) == OFF
    p.observe(OFF, [], 8, 0.127)
    # OFF's estimate at batch 8 came from an extrapolated table (0.19 s): the served rounds outweigh it (what is
    # left: the table's pull, and MID's surprise that the host's factor took after its 8 rounds, +6 %)
    assert p.seconds(OFF, 8) == pytest.approx(0.127, rel=0.12)
    assert p.choose(8) == OFF and p.current == OFF  # 63 tok/s measured vs MID's 51: switched
    for _ in range(20):
        assert p.choose(8) == OFF
        p.observe(OFF, [], 8, 0.127)
    assert p.rounds[BIG.label] == 0 and p.rounds[MID.label] == 1
    # batch 7 is near 8: no new probes; batch 4 is not: its close contenders get a few rounds, once
    assert p.choose(7) == OFF
    for _ in range(2):
        p.observe(OFF, [], 4, 0.07)
    served = {OFF: 0.07, MID: 0.2}  # at batch 4: OFF 57 tok/s, MID 40
    picks = []
    for _ in range(10):
        picks.append(p.choose(4))
        p.observe(picks[-1], [2] * 4, 4, served[picks[-1]])
    # the level settles (4 rounds at batch 4), then MID is probed twice there, then OFF for good
    assert picks[:2] == [OFF, OFF] and picks[2:4] == [MID, MID] and picks[4:] == [OFF] * 6
    assert p.rounds[BIG.label] == 0
    for b in (3, 2, 1):  # a ramp down, one round per size: nothing is probed on the way
        assert p.choose(b) == OFF
        p.observe(OFF, [], b, 0.05)


def test_rounds_of_one_shape_move_the_others_through_the_one_draft_excess():
    """The calibration prompts were less predictable than the traffic: served single-draft rounds accept 2.0 where
    the prior said 1.6. Every shape's estimate scales with h (0.6 -> 1.0), so the deeper shapes, never served,
    now win at batch 1; that shape's own rounds then correct its ratio: it turns out to emit no more than the
    single draft on this traffic, and loses its place."""
    p = policy(hysteresis=0.0, ema=0.1, prior_rounds=4.0)
    p.current = ONE
    for _ in range(160):
        p.observe(ONE, [2], 1, SECONDS[ONE.label][1], {ONE: [2]})
    assert p.hit == pytest.approx(1.0, rel=0.02)
    assert p.accept[BIG] == pytest.approx(1 + 2.2 / 0.6, rel=0.02)
    best = p.choose(1)
    assert best not in (ONE, OFF) and best.label == brute_best({s.label: a for s, a in p.accept.items()}, 1)
    for _ in range(200):
        p.observe(best, [2], 1, SECONDS[best.label][1], {best: [2], ONE: [2]})
    assert p.rho(best) == pytest.approx(1.0, rel=0.02) and p.accept[best] == pytest.approx(2.0, rel=0.02)
    assert p.choose(1) != best


def test_estimates_do_not_keep_the_stretch_a_shape_was_last_served_on():
    """Text alternates between hard and easy stretches. A shape served through a hard stretch, then dropped,
    must not keep that stretch's acceptance while the text is easy again (with per-shape averages of served
    rounds it did, and the policy under-speculated): every estimate follows the text of the recent rounds,
    whichever shape served them. A stretch lasts 50 rounds of 4 requests, twice h's span (1 / hit_ema
    request-rounds). Accept lengths are consistent (a shape emits at least what its sub-shapes do)."""
    true = {  # tokens per request-round of each shape (4 requests) on hard and on easy text
        "hard": {BIG: [2, 2, 3, 4], MID: [2, 2, 2, 3], CHAIN: [2, 2, 2, 2], ONE: [1, 1, 2, 2]},
        "easy": {BIG: [4, 4, 5, 5], MID: [3, 3, 4, 4], CHAIN: [3, 3, 3, 3], ONE: [2, 2, 2, 2]},
    }
    p = policy(hysteresis=0.05, include_off=False)  # OFF rounds know nothing of the text (probes: below)
    served = Counter()
    for stretch in range(8):
        text = "hard" if stretch % 2 == 0 else "easy"
        for _ in range(50):
            shape = p.choose(4)
            served[shape] += 1
            cf = {c: true[text][c] for c in [shape, ONE, *p.sub_shapes(shape)]}
            p.observe(shape, true[text][shape], 4, SECONDS[shape.label][4], cf)
        for c in (BIG, MID, CHAIN, ONE):
            want = sum(true[text][c]) / 4
            assert p.accept[c] == pytest.approx(want, rel=0.15), (stretch, c.label, p.accept[c], want)
    assert len(served) >= 2  # the choice moved with the text


def test_smaller_shapes_learn_from_the_rounds_of_a_bigger_one():
    """A served (4, 4, 16) round reports what every smaller candidate would have emitted for each greedy request
    (eagle_verify.subtree_accept_len): the round moves h and the ratio of every shape it knows, paired on the
    same requests. A shape learns only from rounds of shapes that contain it."""
    p = policy(hysteresis=0.0)
    assert p.sub_shapes(BIG) == [MID, CHAIN, ONE] and p.sub_shapes(MID) == [CHAIN, ONE]
    assert p.sub_shapes(CHAIN) == [ONE] and p.sub_shapes(ONE) == [] and p.sub_shapes(OFF) == []
    cf = {BIG: [4, 1, 3], MID: [3, 1, 3], CHAIN: [4, 1, 3], ONE: [2, 1, 2]}
    p.observe(BIG, [4, 1, 3], 3, SECONDS[BIG.label][2], cf)
    w = 3 / 7  # 3 requests against the prior's 4 request-rounds, in the ratios and in h
    den = (1 - w) * 0.6 + w * 2 / 3
    assert p.hit == pytest.approx(den)
    for c, prior in ((BIG, 2.2), (MID, 1.4), (CHAIN, 1.2)):
        own = sum(cf[c]) / 3 - 1
        assert p.rho(c) == pytest.approx(((1 - w) * prior + w * own) / den), c
        assert p.accept[c] == pytest.approx(1 + p.rho(c) * p.hit)
    assert p.observed[MID] == p.observed[CHAIN] == p.observed[ONE] == p.observed[BIG] == 1
    p.observe(ONE, [2, 2], 2, SECONDS[ONE.label][2], {ONE: [2, 2]})
    assert p.observed[CHAIN] == p.observed[MID] == 1 and p.observed[ONE] == 2
    assert p.rho(ONE) == pytest.approx(1.0)


def test_round_clock_laps_one_batch_only():
    """The policy is fed the spacing of consecutive rounds of the same batch (the scheduler's cycle included);
    the first round of a batch, a new batch and a reset (prefill, release, spec v2 drain) start a new lap."""
    import time

    from treepage.speculative.eagle_worker import RoundClock

    clock = RoundClock()
    assert clock.lap(["a", "b"]) is None
    time.sleep(0.01)
    lap = clock.lap(["a", "b"])
    assert lap is not None and lap >= 0.01
    assert clock.lap(["a"]) is None  # the batch changed
    clock.reset()
    assert clock.lap(["a"]) is None


def test_cache_key_follows_the_weights_not_only_the_path(tmp_path):
    """A head replaced in place keys a new calibration table (its accept priors belong to the old head)."""
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    w = head / "model.safetensors"
    w.write_bytes(b"a" * 10)
    first = weights_fingerprint(str(head))
    assert first.startswith(str(head)) and "model.safetensors:10:" in first
    (head / "config.json").write_text('{"x": 1}')  # not a weight file
    assert weights_fingerprint(str(head)) == first
    w.write_bytes(b"b" * 11)
    assert weights_fingerprint(str(head)) != first
    os.utime(w, ns=(1, 1))
    single = weights_fingerprint(str(w))  # a single-file checkpoint (GGUF) is its own weight file
    assert single == f"{w} [model.safetensors:11:1]"
    assert weights_fingerprint("") == ""


def simulate_batch_one(
    seed: int, hit: float, spread: float = 0.0, rounds: int = 2000, request_rounds: int = 32, **kw
) -> float:
    """Batch-1 rounds on text whose drafts are accepted level by level with probability p, independently each
    round; p is `hit` or, with a `spread`, drawn per request (every `request_rounds` rounds) from a normal
    distribution around it. The policy's tokens/s over the best fixed candidate's (OFF included) on the same
    draws."""
    p = AdaptivePolicy(AdaptiveConfig([BIG, MID, CHAIN, ONE], **kw), table())
    rng = random.Random(seed)
    fixed = [BIG, MID, CHAIN, ONE, OFF]
    tokens: Counter[str] = Counter()  # per fixed candidate's label, and "policy"
    seconds: Counter[str] = Counter()
    level = hit
    for r in range(rounds):
        if spread and r % request_rounds == 0:
            level = min(max(rng.gauss(hit, spread), 0.02), 0.98)
        shape = p.choose(1)
        depth = 0
        while depth < BIG.steps and rng.random() < level:
            depth += 1
        lens = {c: [1 + min(depth, c.steps)] for c in fixed}
        for c in fixed:  # what each fixed candidate would have made of the same round
            tokens[c.label] += lens[c][0]
            seconds[c.label] += SECONDS[c.label][1]
        t = SECONDS[shape.label][1]
        if shape.is_off:
            p.observe(shape, [], 1, t)
        else:
            p.observe(shape, lens[shape], 1, t, {c: lens[c] for c in [shape, ONE, *p.sub_shapes(shape)]})
        tokens["policy"] += lens[shape][0]
        seconds["policy"] += t
    return tokens["policy"] / seconds["policy"] / max(tokens[c.label] / seconds[c.label] for c in fixed)


def test_batch_one_noise_does_not_drive_the_choice(monkeypatch):
    """At batch 1 a round is one request's hit or miss, nearly unpredictable from the rounds before it. An estimate
    of the traffic that moved 10 % per round and stood still while OFF served (no draft runs) followed that noise
    into OFF and stayed at its dip: 0.93 of the best fixed candidate near a tie (OFF 33.3, ONE 35.6, CHAIN 36.3
    tok/s expected). Per request-round weights and the return towards the long-run traffic while OFF serves: 0.96."""
    new = [simulate_batch_one(seed, 0.6) for seed in range(10)]
    monkeypatch.setattr(adaptive, "LONG_HIT_SPAN", 1.0)  # the long-run estimate is h itself: no return
    old = [simulate_batch_one(seed, 0.6, hit_ema=0.1) for seed in range(10)]
    assert sum(new) / 10 >= 0.95 and sum(new) / 10 > sum(old) / 10 + 0.015, (new, old)


def test_cheap_probes_come_often():
    """A close runner-up is cheap to probe, and only its probes correct an estimate that its start-up rounds left
    low; the probe budget bounds what probes cost, so probing every 8 rounds instead of 32 does better near a tie,
    on average and on the unluckiest seed (with requests that differ, as in test_batch_one_pools_over_requests)."""
    often = [simulate_batch_one(seed, 0.6, 0.05, rounds=3000) for seed in range(10)]
    rare = [simulate_batch_one(seed, 0.6, 0.05, rounds=3000, probe_every=32) for seed in range(10)]
    assert sum(often) / 10 > sum(rare) / 10 + 0.005 and min(often) > min(rare) + 0.02, (often, rare)


def test_batch_one_pools_over_requests():
    """Requests differ (the acceptance level of each drawn around 0.6, sd 0.05, about what the batch-1 trace in
    docs/design.md "Adaptive speculation" leaves room for), but a request's few dozen rounds say little about its
    own level: an estimate that spans several requests (hit_ema 0.01 per request-round) chooses better than one
    that follows the current request (0.05): 0.977 against 0.969 over 30 seeds (over the first 10 alone the two
    are within 0.002 of each other)."""
    pooled = [simulate_batch_one(seed, 0.6, 0.05, rounds=3000) for seed in range(30)]
    following = [simulate_batch_one(seed, 0.6, 0.05, rounds=3000, hit_ema=0.05) for seed in range(30)]
    assert sum(pooled) / 30 >= 0.96 and sum(pooled) / 30 > sum(following) / 30 + 0.005, (pooled, following)


def test_the_excess_ratios_are_as_noisy_at_batch_one_as_at_batch_four():
    """The same requests, served one per round or four per round, leave each shape's excess ratio equally noisy:
    its weight is per request-round. With a weight per round, a batch-1 round (one request's hit or miss) moved the
    ratio as much as a batch-16 round and its noise swung the choice between close shapes at c = 1 (run 35,
    docs/benchmarks_adaptive.md)."""
    rng = random.Random(7)
    lens = []  # per request-round: what MID, CHAIN and ONE emit (MID and CHAIN differ beyond the first level)
    for _ in range(8000):
        depth = next((d for d in range(3) if rng.random() > 0.6), 3)
        mid = 1 + depth + (depth < 3 and rng.random() < 0.3)  # MID's second branch sometimes goes one deeper
        lens.append((mid, 1 + depth, 1 + min(depth, 1)))
    spread = {}
    for batch in (1, 4):
        p = policy(hysteresis=0.0)
        trace = []
        for i in range(0, len(lens), batch):
            group = lens[i : i + batch]
            cf = {MID: [g[0] for g in group], CHAIN: [g[1] for g in group], ONE: [g[2] for g in group]}
            p.observe(MID, cf[MID], batch, SECONDS[MID.label][batch], cf)
            if i >= len(lens) // 4:
                trace.append(p.rho(MID))
        mean = sum(trace) / len(trace)
        spread[batch] = (sum((x - mean) ** 2 for x in trace) / len(trace)) ** 0.5
    assert spread[1] == pytest.approx(spread[4], rel=0.25), spread


def test_dear_probes_come_rarer():
    """OFF serves at batch 8; a round of the single draft costs 12 ms more than OFF takes for its tokens, one of
    the (3, 2, 6) tree 88 ms. Every 4 rounds a probe is due, but each waits until 1 % of the time served since the
    last has been set aside for its expected loss: the probes' losses stay near 1 % of the time, the cheap
    runner-up still runs, and without the budget the same schedule loses far more."""

    def run(budget: float) -> tuple[float, float, Counter]:
        p = policy(probe_every=4, probe_budget=budget, hysteresis=0.0, probe_margin=0.0)
        p.current = OFF
        for shape in p.candidates:  # every shape measured at this level already: only periodic probes follow
            for _ in range(2):
                p.observe(shape, [] if shape.is_off else [1, 2] * 4, 8, SECONDS[shape.label][8])
        lost = served = 0.0
        probes: Counter = Counter()
        for _ in range(1000):
            shape = p.choose(8)
            t = SECONDS[shape.label][8]
            if shape != OFF:
                lost += p.probe_loss(shape, OFF, 8)
                probes[shape] += 1
            served += t
            p.observe(shape, [] if shape.is_off else [1, 2] * 4, 8, t)
        return lost, served, probes

    lost, served, probes = run(0.01)
    assert lost <= 0.011 * served and probes[ONE] >= 15 and probes[MID] == probes[BIG] == 0, (lost / served, probes)
    unbudgeted, served_all, all_probes = run(100.0)
    assert unbudgeted >= 0.05 * served_all and all_probes[MID] >= 20, (unbudgeted / served_all, all_probes)


def test_draft_extend_cost_is_a_line_through_both_ends():
    """Prompts (many tokens) and catch-ups (few) pin a + b * n; one size alone goes through the origin."""
    cost = DraftExtendCost()
    assert cost.line() is None and cost.seconds(100) == 0.0
    cost.observe(40, 0.008)
    assert cost.line() == pytest.approx((0.0, 0.0002)) and cost.seconds(0) == 0.0
    rng = random.Random(0)
    for _ in range(200):
        n = rng.choice([1, 3, 16, 48, 300, 700])
        cost.observe(n, (0.004 + 0.00008 * n) * rng.uniform(0.95, 1.05))
    a, b = cost.line()
    assert a == pytest.approx(0.004, rel=0.15) and b == pytest.approx(0.00008, rel=0.05)
    assert cost.seconds(512) == pytest.approx(0.004 + 0.00008 * 512, rel=0.05)


def test_a_probe_from_off_pays_the_draft_catch_up():
    """While OFF serves, the draft falls behind by the batch size every round, and a speculative probe first
    catches it up (draft extends of 5 ms + 0.1 ms a token). Priced in, the probes stop at batch 8, where the
    catch-up grows faster than the 1 % budget sets time aside, and still come at batch 1, where it grows slower;
    unpriced, batch 8 probes every hundred rounds or so."""

    def run(batch: int, priced: bool) -> tuple[int, float, float]:
        p = policy(probe_every=4, hysteresis=0.0, probe_margin=0.0)
        if priced:
            p.observe_draft_extend(10, 0.006)
            p.observe_draft_extend(500, 0.055)
        p.current = OFF
        for shape in p.candidates:  # measured at this level; the traffic makes OFF the best
            for _ in range(2):
                p.observe(shape, [] if shape.is_off else [1] * batch, batch, SECONDS[shape.label][batch])
        lag, probes, lost, served = 0, 0, 0.0, 0.0
        for _ in range(1000):
            shape = p.choose(batch, lag)
            t = SECONDS[shape.label][batch]
            if shape.is_off:
                lag += batch
            else:
                probes += 1
                lost += p.probe_loss(shape, OFF, batch, lag)
                lag = 0
            served += t
            p.observe(shape, [] if shape.is_off else [1] * batch, batch, t)
        return probes, lost, served

    assert run(8, priced=True)[0] == 0
    probes, lost, served = run(1, priced=True)
    assert probes >= 5 and lost <= 0.011 * served, (probes, lost / served)
    assert run(8, priced=False)[0] >= 5
