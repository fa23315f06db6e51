"""Adaptive tree speculation (`--speculative-adaptive`, docs/design.md "Adaptive speculation"): the candidate
shapes, the measured cost table, and the per-round policy that picks the shape with the highest expected output
tokens per second for the current batch.

Pure: nothing here runs a model. `speculative/calibrate.py` measures the table on the machine; the workers ask
`choose(batch_size)` before every round and report what the round accepted with `observe`.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class TreeShape:
    """(steps S, topk K, draft tokens N); OFF (S == 0) is a plain one-token decode inside the speculative worker."""

    steps: int
    topk: int
    draft_tokens: int

    @property
    def is_off(self) -> bool:
        return self.steps == 0

    @property
    def label(self) -> str:
        return "off" if self.is_off else f"{self.steps}x{self.topk}x{self.draft_tokens}"

    @staticmethod
    def parse(label: str) -> TreeShape:
        if label == "off":
            return OFF
        s, k, n = (int(x) for x in label.split("x"))
        return TreeShape(s, k, n)


OFF = TreeShape(0, 1, 1)
# One draft token: a sub-tree of every speculative round (the root's most likely child), so every greedy round
# says what it would have emitted. Its excess over one token is the policy's measure of the traffic.
ONE_DRAFT = TreeShape(1, 1, 2)
LONG_HIT_SPAN = 10.0  # the long-run traffic estimate averages over this many times more request-rounds than h
TIME_PRIOR_ROUNDS = 2.0  # seconds calibrated at this very batch size count as this many served rounds
DERIVED_PRIOR_ROUNDS = 0.5  # an estimate derived from other batch sizes (interpolated, extrapolated, carried)
MIN_PRIOR_EXCESS = 0.05  # a prior this close to one token says nothing about how predictable the traffic is
# weight of one served round's surprise (its time against the expected) in the host's speed factor, which every
# shape's expected time carries: faster than a shape's own time (`AdaptiveConfig.ema`), so a slow stretch of the
# host is taken as the host's, and a shape that was not served meanwhile does not look cheap against the served
# one (run 33, docs/benchmarks_adaptive.md: with the narrow shape margin, 3x1x4 served in 53 % of c = 2's rounds)
HOST_EMA = 0.5
# the host's factor learns only from rounds of a (shape, batch size) served this many times before: the surprise of
# a round whose time is not known yet (a new load level, a shape rarely served) is the shape's own
HOST_SETTLED_ROUNDS = 8
PROBE_ROUNDS = 2  # rounds a close contender serves at a new load level before it counts as measured there
# a load level is probed only once it has lasted this many rounds (batch sizes within a factor 1.5): a ramp of
# arrivals or departures passes through sizes it does not stay at, and probes there cost without paying
SETTLE_ROUNDS = 4


def max_tree_nodes(steps: int, topk: int) -> int:
    """Draft nodes a round can produce: K at step 0, K*K at each later step."""
    return topk + (steps - 1) * topk * topk


def sub_shapes(shapes: Sequence[TreeShape], shape: TreeShape) -> list[TreeShape]:
    """The other shapes whose round a greedy round of `shape` can stand in for: no more steps, topk or draft
    tokens (their tree is rebuilt inside this one: eagle_verify.subtree_accept_len)."""
    return [
        c
        for c in shapes
        if c != shape
        and not c.is_off
        and c.steps <= shape.steps
        and c.topk <= shape.topk
        and c.draft_tokens <= shape.draft_tokens
    ]


def maximal_shapes(shapes: Sequence[TreeShape]) -> list[TreeShape]:
    """The speculative shapes no other one contains: their greedy rounds stand in for all the rest."""
    spec = [s for s in shapes if not s.is_off]
    return [s for s in spec if not any(s in sub_shapes(spec, o) for o in spec)]


def check_shape(shape: TreeShape) -> str | None:
    """Why a speculative shape is invalid, or None."""
    S, K, N = shape.steps, shape.topk, shape.draft_tokens
    if S < 1 or K < 1:
        return f"steps and topk must be >= 1, got {shape.label}"
    if K == 1 and N != S + 1:
        return f"topk 1 makes the tree a chain: draft tokens must be steps + 1, got {shape.label}"
    if not 2 <= N <= 1 + max_tree_nodes(S, K):
        return f"draft tokens must be in 2..{1 + max_tree_nodes(S, K)} for steps {S}, topk {K}, got {shape.label}"
    return None


def default_candidates(configured: TreeShape) -> list[TreeShape]:
    """From the configured shape downwards: halve topk (one step fewer), then a chain, then a single draft.

    (4, 4, 16) gives (4, 4, 16), (3, 2, 6), (3, 1, 4), (1, 1, 2); OFF is added by the policy.
    """
    out = [configured]
    s = max(configured.steps - 1, 1)
    k = configured.topk // 2
    while k > 1:
        out.append(TreeShape(s, k, min(configured.draft_tokens, s * k)))
        k //= 2
    out.append(TreeShape(s, 1, s + 1))
    out.append(TreeShape(1, 1, 2))
    return list(dict.fromkeys(out))  # in order, without repeats


@dataclass
class AdaptiveConfig:
    """What `--speculative-adaptive-config FILE` may set (JSON object with these keys, all optional)."""

    candidates: list[TreeShape]
    include_off: bool = True
    # switch to or from OFF only when the best shape beats the current one by this fraction: such a switch costs
    # (back from OFF, the draft first catches up over the tokens OFF emitted)
    hysteresis: float = 0.05
    # between two speculative shapes a switch costs nothing (the draft keeps the widest candidate list and the
    # holey layout is recomputed every round), so only a small margin against flapping on rounding: one as wide
    # as `hysteresis` would keep a shape up to 5 % behind the best (run 32's c = 4: 3x1x4, 2.4 % behind 1x1x2)
    shape_hysteresis: float = 0.01
    ema: float = 0.1  # weight of one served round in a shape's round-time estimates
    # weight of one request's round in the traffic's estimate (the one-draft excess): per request, not per round,
    # so a batch-1 round (one request's hit or miss, nearly unpredictable from the rounds before it) moves the
    # estimate as little as one request of a batch-16 round does; a faster one chases noise (docs/design.md)
    hit_ema: float = 0.01
    # weight of one request's round in a shape's excess ratio rho (a property of the shape more than of the
    # text, so slower than h): per request too, so at batch 1, where a round is one request's hit or miss, the
    # ratio of two close shapes does not swing the choice between them (run 35: 3x2x6's estimate dipped from
    # 1.92 to 1.81 at 0.02 per round); 0.005 weighs a batch-4 round as the former 0.02 per round did
    ratio_ema: float = 0.005
    prior_rounds: float = 4.0  # the calibration prior counts as this many rounds before the averages take over
    # rounds between probes of another candidate (refreshes its estimates); their cost is bounded by probe_budget,
    # so this only says how often a cheap probe (a close runner-up) may run: at 32 a runner-up whose start-up
    # rounds came out low kept its low estimate (docs/design.md)
    probe_every: int = 8
    explore_rounds: int = 4  # at start-up each candidate serves this many rounds, so served times exist
    # a candidate never served near the current batch size is probed once there when its estimate is at least
    # this fraction of the chosen shape's (a new load level is measured in its first rounds, not 32 later); the
    # periodic probes of lower-ranked candidates keep to the same margin
    probe_margin: float = 0.7
    # a periodic probe also waits until the rounds since the last one have set aside this share of their time for
    # its expected loss (what the probed shape's round costs beyond the chosen shape's time for the same tokens);
    # a lower-ranked pick that cannot wait its turn out gives it up: cheap probes keep to probe_every, dear ones
    # (a tree at batch 16 while OFF serves) come rarer or not at all
    probe_budget: float = 0.01

    @staticmethod
    def load(path: str, configured: TreeShape) -> AdaptiveConfig:
        with open(path) as f:
            raw = json.load(f)
        if not isinstance(raw, dict):
            raise ValueError(f"--speculative-adaptive-config {path}: expected a JSON object")
        known = {k.name for k in fields(AdaptiveConfig)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(
                f"--speculative-adaptive-config {path}: unknown keys {sorted(unknown)}; allowed {sorted(known)}"
            )
        cands = [TreeShape(*map(int, c)) for c in raw.get("candidates", [])] or default_candidates(configured)
        for c in cands:
            why = check_shape(c)
            if why:
                raise ValueError(f"--speculative-adaptive-config {path}: {why}")
        cfg = AdaptiveConfig(cands)
        for key in known - {"candidates"}:
            if key in raw:
                setattr(cfg, key, type(getattr(cfg, key))(raw[key]))
        return cfg


def ema_weight(per_sample: float, samples: int) -> float:
    """The weight of `samples` new samples together in an EMA of weight `per_sample` each."""
    return 1.0 - (1.0 - per_sample) ** samples


def on_segment(pts: list[tuple[int, float]], batch: int) -> float:
    """The line through the two measured (batch size, seconds) points around `batch` (sorted, at least two; below
    the first point, the first segment's line)."""
    i = max(bisect.bisect_left([b for b, _ in pts], batch), 1)
    (b0, t0), (b1, t1) = pts[i - 1], pts[i]
    return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)


# ---- the cost table ---------------------------------------------------------------------------------------------
@dataclass
class CostTable:
    """Seconds per round for each shape (label) at measured batch sizes, and the accept length per round each
    shape reached during calibration (the prior of the online estimate). `key` names what it was measured on."""

    round_seconds: dict[str, dict[int, float]]
    prior_accept: dict[str, float]
    key: dict[str, str] = field(default_factory=dict)

    def seconds(self, shape: TreeShape, batch: int) -> float:
        """Piecewise-linear in the batch size inside the measured range; beyond it, the last point plus the
        least-squares slope of all points (a noisy last segment must not make large batches look free)."""
        pts = sorted(self.round_seconds[shape.label].items())
        xs = [b for b, _ in pts]
        if len(pts) == 1:
            return pts[0][1] * batch / xs[0]
        if batch >= xs[-1]:
            mx, my = statistics.fmean(xs), statistics.fmean(t for _, t in pts)
            slope = sum((x - mx) * (t - my) for x, t in pts) / sum((x - mx) ** 2 for x in xs)
            return pts[-1][1] + max(slope, 0.0) * (batch - xs[-1])
        return max(on_segment(pts, batch), 1e-9)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "round_seconds": {s: {str(b): t for b, t in v.items()} for s, v in self.round_seconds.items()},
            "prior_accept": self.prior_accept,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> CostTable:
        return CostTable(
            round_seconds={
                s: {int(b): float(t) for b, t in v.items()} for s, v in d["round_seconds"].items()
            },
            prior_accept={s: float(a) for s, a in d["prior_accept"].items()},
            key=dict(d.get("key", {})),
        )

    def covers(self, shapes: list[TreeShape]) -> bool:
        return all(s.label in self.round_seconds and s.label in self.prior_accept for s in shapes)


def cache_key(
    model: str, draft: str, device: str, dtype: str, torch_version: str, extra: str
) -> dict[str, str]:
    """What a cached table is valid for; `extra` carries the algorithm, page size and candidates."""
    return {
        "model": model,
        "draft": draft,
        "device": device,
        "dtype": dtype,
        "torch": torch_version,
        "extra": extra,
    }


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def weights_fingerprint(path: str) -> str:
    """A checkpoint path plus the size and modification time of its weight files: a head replaced in place (a new
    shipped head, a retrained one) keys a new table instead of inheriting the old head's accept-length priors."""
    if not path:
        return path
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.glob("*") if f.suffix in WEIGHT_SUFFIXES)
    stats = [f"{f.name}:{st.st_size}:{st.st_mtime_ns}" for f in files if f.is_file() for st in (f.stat(),)]
    return f"{path} [{' '.join(stats)}]" if stats else path


def default_cache_path(key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = os.environ.get("TREEPAGE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "treepage")
    return Path(root) / "adaptive" / f"{digest}.json"


def load_table(path: Path, key: dict[str, str] | None) -> CostTable | None:
    """The table at path if it exists (and matches key, unless key is None: a pinned file is trusted)."""
    try:
        table = CostTable.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError):
        return None
    if key is not None and table.key != key:
        return None
    return table


def save_table(path: Path, table: CostTable) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table.to_json(), indent=1, sort_keys=True))
    tmp.replace(path)


class DraftExtendCost:
    """Seconds of one draft extend over n tokens, a + b * n, fitted to the recent extends by exponentially weighted
    least squares. The workers report the draft's prompt prefills (many tokens) and its catch-ups over the tokens
    of the OFF rounds since it last ran (eagle_worker.EagleWorker._catch_up, few), so both ends of the line are
    seen. A speculative round after OFF rounds pays a catch-up first; the policy prices it into a probe."""

    def __init__(self, weight: float = 0.05) -> None:
        self.weight = weight  # of one extend
        self.sums = (0.0, 0.0, 0.0, 0.0, 0.0)  # weighted sums of 1, n, n^2, t and n * t

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        n, keep = float(tokens), 1.0 - self.weight
        w, sn, snn, st, snt = (keep * x for x in self.sums)
        self.sums = (w + 1.0, sn + n, snn + n * n, st + seconds, snt + n * seconds)

    def line(self) -> tuple[float, float] | None:
        """(a, b); None before any extend; through the origin while every extend had the same size."""
        w, sn, snn, st, snt = self.sums
        if w == 0.0:
            return None
        det = w * snn - sn * sn
        if det <= 1e-9 * w * snn:
            return 0.0, st / sn
        b = max((w * snt - sn * st) / det, 0.0)
        return max((st - b * sn) / w, 0.0), b

    def seconds(self, tokens: int) -> float:
        line = self.line()
        if tokens <= 0 or line is None:
            return 0.0
        return line[0] + line[1] * tokens


# ---- policies -----------------------------------------------------------------------------------------------------
class ShapePolicy(Protocol):
    def choose(self, batch_size: int, draft_lag: int = 0) -> TreeShape: ...

    def observe_draft_extend(self, tokens: int, seconds: float) -> None: ...

    def observe(
        self,
        shape: TreeShape,
        accept_lens: list[int],
        batch: int,
        seconds: float,
        counterfactual: dict[TreeShape, list[int]] | None = None,
    ) -> None: ...

    def snapshot(self) -> dict[str, Any]: ...


class AdaptivePolicy:
    """argmax over candidates of E[accept] * B / t_round(shape, B), with hysteresis (wide around OFF, narrow between
    speculative shapes, where a switch costs nothing) and occasional probes.

    E[accept] (tokens emitted per request-round: accepted drafts + the bonus token; OFF emits exactly one) is
    1 + rho(shape) * h. h, the traffic, is an EMA over the requests of every speculative round of the one-draft excess
    (how often the target takes the draft's most likely first token; `hit_ema` per request-round): every greedy
    round of any shape knows it (eagle_verify.subtree_accept_len of ONE_DRAFT), so it tracks the text whatever is
    served. rho(shape) is the shape's excess over one token per unit of h, a slow ratio of averages (`ratio_ema`
    per request-round) over the rounds where the shape's accept length is known in the same round: rounds it
    served, and greedy rounds of any shape that contains it (`sub_shapes`). Paired on the same rounds, rho does
    not depend on which stretch of text the shape happened to be served on; the calibration prior counts as
    `prior_rounds` request-rounds of h and of each rho. t_round(shape, B) is an EMA (in log space, so one slow
    outlier does not dominate) of the laps (eagle_worker.RoundClock) of the rounds served with that shape at that
    batch size, starting from the calibrated table times a per-shape scale learnt the same way at any batch size:
    a calibration disturbed by other processes, or serving conditions it did not see (the overlap thread next to
    the scheduler, longer contexts), is corrected within a few rounds. All of these are net of a speed factor
    of the host that every shape's time carries (HOST_EMA): a slow stretch of the host moves every shape's
    expected time, so a shape not served meanwhile does not come to look cheap against the served one. A shape
    that is never chosen would keep stale estimates forever (and OFF would never learn that the traffic became
    predictable), so every `probe_every` rounds another candidate (OFF included) runs once: in turn the best
    other one, and the one served longest ago among the rest whose estimate is within `probe_margin` of the
    chosen shape's (ranked below the runner-up, a shape whose estimate came out low, say from its few start-up
    rounds, would otherwise never be measured again; one far below is not worth a round). A probe also waits
    until `probe_budget` of the time served since the last one covers its `probe_loss`; a lower-ranked pick
    that cannot pay gives up its turn (at batch 16, while OFF served, the probes of the single draft and the
    trees cost 2-14 % of a pass); a speculative probe after OFF rounds first catches the draft up over their
    tokens (`draft_lag`, priced by DraftExtendCost), so while OFF serves a full batch no speculative shape is
    probed.
    While OFF serves no draft runs, so h, stale, returns towards a LONG_HIT_SPAN times slower average of the same
    samples.
    Before any choice, each candidate serves `explore_rounds` rounds, so every shape's per-shape scale starts
    from served rounds. When the load changes and the new level lasts (SETTLE_ROUNDS), the batch size
    is one no round has been served at: there, a candidate whose estimate comes close to the chosen shape's
    (`probe_margin`) and that was never served near this size runs twice, so the decision at the new load rests
    on what rounds cost at that load; the sizes a ramp of arrivals or departures passes through are not probed.
    """

    def __init__(self, config: AdaptiveConfig, table: CostTable) -> None:
        self.config = config
        self.candidates = list(config.candidates) + ([OFF] if config.include_off else [])
        self.table = table
        spec = [c for c in self.candidates if not c.is_off]
        excess = {c: max(table.prior_accept[c.label] - 1.0, MIN_PRIOR_EXCESS) for c in spec}
        # the calibration's one-draft excess; without that candidate, the smallest one bounds it from above
        hit0 = table.prior_accept.get(ONE_DRAFT.label)
        hit0 = max(hit0 - 1.0, MIN_PRIOR_EXCESS) if hit0 is not None else min(excess.values(), default=0.5)
        self.hit = hit0  # h: the one-draft excess of the recent request-rounds
        self.hit_samples = 0  # request-rounds behind h
        self.hit_long = hit0  # the same, LONG_HIT_SPAN times slower: where h returns to while OFF serves
        # rho = num / den: averages of the shape's excess and of the one-draft excess over the same rounds
        self.ratio_num = dict(excess)
        self.ratio_den = dict.fromkeys(spec, hit0)
        self.ratio_samples: Counter[TreeShape] = Counter()  # request-rounds behind num and den, beside the prior
        self.accept: dict[TreeShape, float] = {c: 1.0 for c in self.candidates}  # the E[accept] ranked by
        self._refresh_accept()
        self.rounds: Counter[str] = Counter()
        self.observed: Counter[TreeShape] = Counter()
        self.log_time_scale: dict[TreeShape, float] = dict.fromkeys(self.candidates, 0.0)
        self.timed: Counter[TreeShape] = Counter()
        self.served_log_seconds: dict[tuple[TreeShape, int], float] = {}  # per (shape, batch size)
        self.served: Counter[tuple[TreeShape, int]] = Counter()
        # log of the host's speed factor, common to every shape: a stretch where the host runs slow (another
        # process on the cores) slows whatever is served, so it moves every shape's time, not only the served one's
        self.log_host = 0.0
        self.current: TreeShape = self.candidates[0]
        self._since_probe = 0
        self._probes = 0
        self._probe_credit = 0.0  # seconds set aside for the next periodic probe's expected loss
        self.last_served: dict[TreeShape, int] = dict.fromkeys(self.candidates, -1)  # the round it last ran
        self._level = 0  # the batch size of the current load level, and the rounds served at it in a row
        self._level_rounds = 0
        self.draft_extend = DraftExtendCost()

    def rate(self, shape: TreeShape, batch: int) -> float:
        """Expected output tokens per second of a round of this shape at this batch size."""
        return self.accept[shape] * batch / self.seconds(shape, batch)

    def seconds(self, shape: TreeShape, batch: int) -> float:
        """Expected seconds of one round: the host's current speed factor times the shape's own time."""
        return math.exp(self.log_host) * self.base_seconds(shape, batch)

    def base_seconds(self, shape: TreeShape, batch: int) -> float:
        """A round's seconds net of the host's speed: what served rounds of this shape at this batch size took;
        else what they took at the nearest served batch size, carried over by the table's ratio between the two
        sizes; else the calibrated table scaled by what this shape's served rounds took at any batch size."""
        served = self.served_log_seconds.get((shape, batch))
        if served is not None:
            return math.exp(served)
        near = self._nearest_served(shape, batch)
        if near is not None:
            ratio = self.table.seconds(shape, batch) / self.table.seconds(shape, near)
            return math.exp(self.served_log_seconds[(shape, near)]) * ratio
        return self.table.seconds(shape, batch) * math.exp(self.log_time_scale[shape])

    def _nearest_served(self, shape: TreeShape, batch: int) -> int | None:
        """The served batch size of this shape closest to `batch` in ratio (ties: the larger), or None."""
        sizes = [b for (s, b) in self.served_log_seconds if s == shape]
        if not sizes:
            return None
        return min(sizes, key=lambda b: (abs(math.log(b / batch)), -b))

    def _served_near(self, shape: TreeShape, batch: int, rounds: int = 1) -> bool:
        """At least `rounds` rounds of this shape were served at batch sizes within a factor 1.5 of `batch`."""
        near = sum(n for (s, b), n in self.served.items() if s == shape and max(b, batch) <= 1.5 * min(b, batch))
        return near >= rounds

    def _unmeasured_rival(self, chosen: TreeShape, batch: int) -> TreeShape | None:
        """The best candidate never served near this batch size whose estimate is within the probe margin."""
        rivals = [
            c for c in self._within_margin(chosen, batch) if not self._served_near(c, batch, PROBE_ROUNDS)
        ]
        return max(rivals, key=lambda c: self.rate(c, batch)) if rivals else None

    def _within_margin(self, chosen: TreeShape, batch: int) -> list[TreeShape]:
        """The other candidates whose expected rate is within the probe margin of the chosen shape's: the ones
        worth measuring."""
        floor = self.config.probe_margin * self.rate(chosen, batch)
        return [c for c in self.candidates if c != chosen and self.rate(c, batch) >= floor]

    def _same_level(self, batch: int) -> bool:
        return self._level > 0 and max(batch, self._level) <= 1.5 * min(batch, self._level)

    def _weight(self, n: int, prior: float, ema: float | None = None, m: int = 1) -> float:
        """Weight of m new samples in a running mean that starts with the prior worth `prior` samples and has seen
        n, until it is an EMA of weight `ema` per sample (default: the round-time EMA, one sample a round)."""
        return max(ema_weight(self.config.ema if ema is None else ema, m), m / (prior + n + m))

    def best(self, batch: int) -> TreeShape:
        """The candidate with the highest expected rate, keeping the current one unless beaten by the margin
        (`hysteresis` for a switch to or from OFF, `shape_hysteresis` between speculative shapes)."""
        top = max(self.candidates, key=lambda c: self.rate(c, batch))
        off_switch = top.is_off or self.current.is_off
        margin = self.config.hysteresis if off_switch else self.config.shape_hysteresis
        if top != self.current and self.rate(top, batch) <= self.rate(self.current, batch) * (1 + margin):
            return self.current
        return top

    def choose(self, batch_size: int, draft_lag: int = 0) -> TreeShape:
        """The next round's shape; `draft_lag`: the tokens (summed over the batch) that OFF rounds emitted since
        the draft last ran, which a speculative round first catches the draft up over."""
        unexplored = [c for c in self.candidates if self.rounds[c.label] < self.config.explore_rounds]
        if unexplored:  # the calibration ran in other conditions than serving: measure each shape served
            return self._serve(min(unexplored, key=lambda c: self.rounds[c.label]))
        chosen = self.best(batch_size)
        if chosen != self.current:
            logger.info(
                "speculative shape %s -> %s at batch %d (expected %.1f vs %.1f tok/s)",
                self.current.label,
                chosen.label,
                batch_size,
                self.rate(chosen, batch_size),
                self.rate(self.current, batch_size),
            )
            self.current = chosen
        self._since_probe += 1
        self._probe_credit += self.config.probe_budget * self.seconds(chosen, batch_size)
        settled = self._level_rounds >= SETTLE_ROUNDS and self._same_level(batch_size)
        measured = settled and self._served_near(chosen, batch_size)
        rival = self._unmeasured_rival(chosen, batch_size) if measured else None
        if rival is not None:  # a new load level: measure the close contenders there before settling
            chosen = rival
        elif self.config.probe_every > 0 and self._since_probe >= self.config.probe_every:
            probe, rotation = self._probe(chosen, batch_size)
            paid = self._probe_credit >= self.probe_loss(probe, chosen, batch_size, draft_lag)
            if paid or rotation:  # the turn is taken, or a dear pick of the rotation gives it up
                self._since_probe = 0
                self._probes += 1
            if paid:
                self._probe_credit = 0.0
                chosen = probe
        return self._serve(chosen)

    def probe_loss(self, probe: TreeShape, chosen: TreeShape, batch: int, draft_lag: int = 0) -> float:
        """Expected seconds a round of `probe` costs beyond what `chosen` takes to emit the same tokens, with the
        draft's catch-up over `draft_lag` tokens before a speculative probe."""
        extra = self.seconds(probe, batch) - self.accept[probe] * batch / self.rate(chosen, batch)
        return max(0.0, extra) + (0.0 if probe.is_off else self.draft_extend.seconds(draft_lag))

    def observe_draft_extend(self, tokens: int, seconds: float) -> None:
        """A draft extend over this many tokens (a prompt's, or a catch-up after OFF rounds) took these seconds."""
        self.draft_extend.observe(tokens, seconds)

    def _serve(self, shape: TreeShape) -> TreeShape:
        self.rounds[shape.label] += 1
        self.last_served[shape] = self.rounds.total()
        return shape

    def _probe(self, chosen: TreeShape, batch: int) -> tuple[TreeShape, bool]:
        """The candidate a periodic probe runs instead of `chosen`, and whether it is the rotation's pick: turn by
        turn the runner-up and, among the others whose estimate is within the probe margin of the chosen shape's,
        the one served longest ago (ties: the higher expected rate; none within the margin: the runner-up)."""
        others = sorted((c for c in self.candidates if c != chosen), key=lambda c: -self.rate(c, batch))
        if not others:
            return chosen, False
        close = self._within_margin(chosen, batch)
        rest = [c for c in others[1:] if c in close]
        if self._probes % 2 == 0 or not rest:
            return others[0], False
        return min(rest, key=lambda c: self.last_served[c]), True

    def sub_shapes(self, shape: TreeShape) -> list[TreeShape]:
        return sub_shapes(self.candidates, shape)

    def observe(
        self,
        shape: TreeShape,
        accept_lens: list[int],
        batch: int,
        seconds: float,
        counterfactual: dict[TreeShape, list[int]] | None = None,
    ) -> None:
        """A served round: the tokens each request emitted, the batch size and the round's wall time; and, for
        its greedy requests (the same ones, in the same order, in every list), what the served shape, ONE_DRAFT
        and each of `sub_shapes(shape)` emitted or would have emitted from the same draft state
        (eagle_verify.subtree_accept_len)."""
        if shape not in self.accept or batch < 1:
            return
        if self._same_level(batch):
            self._level_rounds += 1
        else:
            self._level, self._level_rounds = batch, 1
        log_s = math.log(max(seconds, 1e-6))
        key = (shape, batch)
        before = math.log(self.base_seconds(shape, batch))
        if self.served[key] >= HOST_SETTLED_ROUNDS:  # a known time: the host's factor takes the surprise first
            self.log_host += HOST_EMA * (log_s - self.log_host - before)
        net = log_s - self.log_host
        calibrated_here = batch in self.table.round_seconds.get(shape.label, {})
        w = self._weight(self.served[key], TIME_PRIOR_ROUNDS if calibrated_here else DERIVED_PRIOR_ROUNDS)
        self.served[key] += 1
        self.served_log_seconds[key] = (1 - w) * before + w * net
        w = self._weight(self.timed[shape], TIME_PRIOR_ROUNDS)
        self.timed[shape] += 1
        ratio = net - math.log(self.table.seconds(shape, batch))
        self.log_time_scale[shape] = (1 - w) * self.log_time_scale[shape] + w * ratio
        if shape.is_off:  # no draft ran: h, stale, returns towards the long-run traffic at the rate it learns
            w = ema_weight(self.config.hit_ema, batch)
            self.hit = (1 - w) * self.hit + w * self.hit_long
            self._refresh_accept()
            return
        if not accept_lens:
            return
        self._observe_accept(shape, accept_lens, counterfactual or {})

    def _observe_accept(
        self, shape: TreeShape, accept_lens: list[int], counterfactual: dict[TreeShape, list[int]]
    ) -> None:
        """h from the round's one-draft excess, and rho of every shape whose accept length the round knows."""

        def excess(lens: list[int]) -> float:
            return sum(lens) / len(lens) - 1.0

        ref = counterfactual.get(ONE_DRAFT) or (accept_lens if shape == ONE_DRAFT else None)
        if ref:
            hit, m = excess(ref), len(ref)  # the round's m greedy requests: m samples of h and of each ratio
            for c, lens in counterfactual.items():
                if c in self.ratio_num and lens and len(lens) == m:
                    w = self._weight(self.ratio_samples[c], self.config.prior_rounds, self.config.ratio_ema, m)
                    self.ratio_samples[c] += m
                    self.ratio_num[c] = (1 - w) * self.ratio_num[c] + w * excess(lens)
                    self.ratio_den[c] = (1 - w) * self.ratio_den[c] + w * hit
                    self.observed[c] += 1
            if shape == ONE_DRAFT and shape not in counterfactual:
                self.observed[shape] += 1
        else:  # no greedy request: the served shape's own excess, through its ratio
            hit = excess(accept_lens) / max(self.rho(shape), 1e-6)
            self.observed[shape] += 1
        n = len(ref) if ref else len(accept_lens)  # `hit` is the mean over the round's n requests: n samples
        k, seen, ema = self.config.prior_rounds, self.hit_samples, self.config.hit_ema
        w, w_long = self._weight(seen, k, ema, n), self._weight(seen, k, ema / LONG_HIT_SPAN, n)
        self.hit_samples += n
        self.hit = (1 - w) * self.hit + w * hit
        self.hit_long = (1 - w_long) * self.hit_long + w_long * hit
        self._refresh_accept()

    def rho(self, shape: TreeShape) -> float:
        """The shape's excess over one token per unit of the one-draft excess."""
        return self.ratio_num[shape] / max(self.ratio_den[shape], 1e-6)

    def expected_accept(self, shape: TreeShape) -> float:
        return 1.0 if shape.is_off else 1.0 + self.rho(shape) * self.hit

    def _refresh_accept(self) -> None:
        for c in self.candidates:
            self.accept[c] = self.expected_accept(c)

    def snapshot(self) -> dict[str, Any]:
        line = self.draft_extend.line()  # the catch-up's cost: a + b * tokens
        return {
            "policy": "adaptive",
            "current": self.current.label,
            "candidates": [c.label for c in self.candidates],
            "rounds": {c.label: self.rounds[c.label] for c in self.candidates},
            "accept_estimate": {c.label: round(a, 4) for c, a in self.accept.items()},
            "one_draft_excess": round(self.hit, 4),  # h
            "excess_ratio": {c.label: round(self.rho(c), 4) for c in self.ratio_num},
            # rounds each estimate has seen: served ones, and those of bigger shapes that contain it
            "accept_rounds": {c.label: self.observed[c] for c in self.candidates if not c.is_off},
            "time_scale": {c.label: round(math.exp(x), 4) for c, x in self.log_time_scale.items()},
            "host_speed_factor": round(math.exp(self.log_host), 4),  # every shape's time is multiplied by it
            "served_seconds": {
                c.label: {
                    b: round(math.exp(x), 5)
                    for (s, b), x in sorted(self.served_log_seconds.items())
                    if s == c
                }
                for c in self.candidates
            },
            "draft_extend_seconds": None if line is None else {"fixed": line[0], "per_token": line[1]},
            "calibration": self.table.to_json(),
        }


class CyclePolicy:
    """Debug schedule (`--speculative-adaptive-debug-cycle`): a different shape every round, cycling through all
    candidates and OFF, so the exactness tests cross every switch."""

    def __init__(self, candidates: list[TreeShape]) -> None:
        self.candidates = list(candidates) + [OFF]
        self.rounds: Counter[str] = Counter()
        self._i = 0

    def choose(self, batch_size: int, draft_lag: int = 0) -> TreeShape:
        shape = self.candidates[self._i % len(self.candidates)]
        self._i += 1
        self.rounds[shape.label] += 1
        return shape

    def observe(
        self,
        shape: TreeShape,
        accept_lens: list[int],
        batch: int,
        seconds: float,
        counterfactual: dict[TreeShape, list[int]] | None = None,
    ) -> None:
        """Nothing to learn: the schedule is fixed."""

    def observe_draft_extend(self, tokens: int, seconds: float) -> None:
        """Nothing to price: the schedule is fixed."""

    def snapshot(self) -> dict[str, Any]:
        return {
            "policy": "debug_cycle",
            "candidates": [c.label for c in self.candidates],
            "rounds": {c.label: self.rounds[c.label] for c in self.candidates},
        }
