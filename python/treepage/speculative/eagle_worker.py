"""Spec v1: synchronous EAGLE / EAGLE-3 / STANDALONE rounds (draft tree -> verify -> draft extend -> commit).

One round per request batch (docs/design.md, "One round"). The draft KV uses the holey per-branch layout of
draft_layout.py (degrading to the contiguous layout at P == 1 or K == 1); the target verifies the N tree tokens
in the contiguous window [L, L+N) of the same rows. Every round takes its shape (S, K, N) as an argument: with
adaptive speculation (docs/design.md, "Adaptive speculation") a policy picks it per round, and OFF runs a plain
one-token decode whose draft-side catch-up is deferred to the next speculative round.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from treepage.core import Req, StepOutput
from treepage.layers import logits_processor, logprobs
from treepage.layers.forward_batch import CaptureHidden, ForwardMode
from treepage.layers.sampler import sample_last, sample_reqs
from treepage.model_executor.model_runner import ModelRunner
from treepage.model_executor.worker import Worker
from treepage.server_args import ServerArgs
from treepage.speculative import draft_layout as dl
from treepage.speculative.adaptive import (
    ONE_DRAFT,
    AdaptiveConfig,
    AdaptivePolicy,
    CostTable,
    CyclePolicy,
    ShapePolicy,
    TreeShape,
    sub_shapes,
)
from treepage.speculative.eagle_tree import (
    EagleTree,
    build_tree,
    draft_step_first,
    draft_step_last,
    draft_step_next,
)
from treepage.speculative.eagle_verify import (
    VerifyResult,
    first_branch_of,
    subtree_accept_len,
    verify_tree_greedy,
    verify_tree_sampling,
)

logger = logging.getLogger(__name__)

OFF_DRAFT_SYNC_ENV = "TREEPAGE_OFF_DRAFT_SYNC"
# "0" keeps draft candidates a grammar forbids (benchmark/bench_grammar.py measures the accept length both ways)
GRAMMAR_PRUNE_ENV = "TREEPAGE_GRAMMAR_DRAFT_PRUNE"


@dataclass
class SpecState:
    """Per request, carried between rounds and written only by the round that runs (under spec v2 on the forward
    thread): the committed target KV length as of that round, the root and the next tree's step 0. The
    scheduler's `Req.kv_committed_len` catches up when the round's StepOutput is handed back."""

    committed: int
    root: int
    topk_p: torch.Tensor  # [K_max] over the shapes; a round of topk K reads the first K (sorted descending)
    topk_index: torch.Tensor  # [K_max] target ids
    hidden: torch.Tensor  # [H] draft recurrent state of the row that consumed the root
    # Off rounds since the last draft extend: the tokens they emitted and the target features of their
    # positions. The draft consumes them (one extend) before the next speculative round; until then topk_p,
    # topk_index and hidden are those of position committed - len(catchup_tokens) - 1.
    catchup_tokens: list[int] = field(default_factory=list)
    catchup_features: list[torch.Tensor] = field(default_factory=list)


class SpecDebugCounters:
    """Per-round accepted depth and the branch of the accepted path (tests and benchmarks read these)."""

    def __init__(self) -> None:
        self.rounds = 0
        self.emitted = 0
        self.accept_len_hist: Counter[int] = Counter()
        self.branch_hist: Counter[int] = Counter()

    def record(self, accept_len: list[int], branch: list[int]) -> None:
        self.rounds += len(accept_len)
        self.emitted += sum(accept_len)
        self.accept_len_hist.update(accept_len)
        self.branch_hist.update(branch)

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "emitted": self.emitted,
            "accept_len_hist": dict(sorted(self.accept_len_hist.items())),
            "branch_hist": dict(sorted(self.branch_hist.items())),
        }


@dataclass
class RoundTime:
    """A round's wall time, and the draft's catch-up over the tokens of the OFF rounds before it, which the round
    ran first (the policy times the round without it and prices the catch-up on its own)."""

    seconds: float
    catchup_tokens: int
    catchup_seconds: float


class RoundClock:
    """The spacing of consecutive decode rounds of one batch as the scheduler sees them. A round costs
    throughput the longer of its forward and the scheduler's own cycle around it (outputs, detokenisation,
    reservation, and under spec v2 the hand-off between the threads), so the policy is fed the lap, not the
    forward alone (docs/design.md "Adaptive speculation"). A new batch or a prefill starts a new lap."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.rids: list[str] = []

    def lap(self, rids: list[str]) -> float | None:
        """Seconds since the previous lap of the same batch, or None; starts the next lap."""
        now = time.perf_counter()
        since = now - self.last if self.last is not None and rids == self.rids else None
        self.last, self.rids = now, list(rids)
        return since

    def reset(self) -> None:
        self.last = None


class EagleWorker(Worker):
    def __init__(self, args: ServerArgs, target: ModelRunner, draft: ModelRunner) -> None:
        self.runner = target  # the target model's
        self.draft = draft
        self.pools = target.pools
        self.device = target.device
        K, S, N = args.speculative_eagle_topk, args.speculative_num_steps, args.speculative_num_draft_tokens
        assert K and S and N, "resolve_server_args first"
        self.P = target.page_size
        self.shape = TreeShape(S, K, N)
        self.shapes = [TreeShape(*x) for x in args.speculative_shapes] or [self.shape]
        self.K_max = max(s.topk for s in self.shapes)  # the draft extend keeps this many top candidates
        self.fixed_accept = args.speculative_debug_fixed_accept_len
        kind = getattr(draft.model, "feature_kind", "")  # a STANDALONE draft (plain Llama) reads no features
        self.capture = {"last": CaptureHidden.LAST, "aux": CaptureHidden.AUX}.get(kind, CaptureHidden.NONE)
        self.states: dict[str, SpecState] = {}
        self.debug = SpecDebugCounters()
        self.prune_drafts = os.environ.get(GRAMMAR_PRUNE_ENV, "1") != "0"
        self.clock = RoundClock()
        self.off_draft_sync = os.environ.get(OFF_DRAFT_SYNC_ENV, "lazy")
        if self.off_draft_sync not in ("lazy", "eager"):
            raise ValueError(f"{OFF_DRAFT_SYNC_ENV} must be 'lazy' or 'eager', got {self.off_draft_sync!r}")
        # None: every round uses the configured shape. Adaptive speculation sets an AdaptivePolicy once the
        # cost table is measured (set_cost_table); the debug cycle needs no table.
        self.adaptive_config: AdaptiveConfig | None = None
        self.policy: ShapePolicy | None = None
        if args.speculative_adaptive:
            path = args.speculative_adaptive_config  # its candidates were resolved into self.shapes
            self.adaptive_config = AdaptiveConfig.load(path, self.shape) if path else AdaptiveConfig(self.shapes)
            self.adaptive_config.candidates = self.shapes
            if args.speculative_adaptive_debug_cycle:
                self.policy = CyclePolicy(self.shapes)

    def set_cost_table(self, table: CostTable) -> None:
        """Start adapting: from now on every round's shape comes from the policy over this table."""
        assert self.adaptive_config is not None, "adaptive speculation is off"
        self.policy = AdaptivePolicy(self.adaptive_config, table)

    def next_shape(self, reqs: list[Req]) -> TreeShape:
        if self.policy is None:
            return self.shape
        lag = sum(len(self.states[r.rid].catchup_tokens) for r in reqs)
        return self.policy.choose(len(reqs), lag)

    def observe(self, shape: TreeShape, outs: list[StepOutput], timing: RoundTime, lap: float | None = None) -> None:
        """Feed a finished round's accept lengths and time (the longer of the round and its lap, without the
        draft's catch-up) to the policy, and the catch-up's time on its own (on the scheduler thread)."""
        if self.policy is None:
            return
        self.policy.observe_draft_extend(timing.catchup_tokens, timing.catchup_seconds)
        seconds = max(timing.seconds, (lap or 0.0) - timing.catchup_seconds)
        accept = [len(o.tokens) for o in outs if o.verified and o.tokens]
        alt: dict[TreeShape, list[int]] = {}
        for o in outs:
            for label, n in (o.subtree_accept or {}).items():
                alt.setdefault(TreeShape.parse(label), []).append(n)
        self.policy.observe(shape, accept, len(outs), seconds, alt)

    def sync_device(self) -> None:
        """Wait for the device, so the host clock times what ran."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed_round(
        self, reqs: list[Req], allocated: list[int], shape: TreeShape
    ) -> tuple[list[StepOutput], RoundTime]:
        """run_round and its wall time (the round ends with host copies of its tokens, so a GPU is synced), the
        draft's catch-up before a speculative round timed apart."""
        t0 = time.perf_counter()
        caught = 0 if shape.is_off else self._catch_up(reqs)
        if caught:
            self.sync_device()
        t1 = time.perf_counter()
        outs = self.run_round(reqs, allocated, shape)
        return outs, RoundTime(time.perf_counter() - t1, caught, t1 - t0)

    # ---- the worker contract ----------------------------------------------------------------------------------
    def release(self, rids: list[str]) -> None:
        self.clock.reset()
        for rid in rids:
            self.states.pop(rid, None)

    def drain(self) -> None:
        """Rounds are synchronous."""

    def model_runners(self) -> list[ModelRunner]:
        return [self.runner, self.draft]

    def decode(self, reqs: list[Req]) -> list[StepOutput]:
        shape = self.next_shape(reqs)
        outs, timing = self.timed_round(reqs, [r.allocated_len for r in reqs], shape)
        self.observe(shape, outs, timing, self.clock.lap([r.rid for r in reqs]))
        return outs

    @torch.inference_mode()
    def prefill(self, reqs: list[Req], ends: list[int]) -> list[StepOutput]:
        """Target forward over each chunk, then the draft extend over the same positions: the draft's input at
        position p is token p + 1, which is the prompt's next token, or the sampled one at the end of the ids."""
        self.clock.reset()
        starts = [r.kv_committed_len for r in reqs]
        ids = [r.all_ids() for r in reqs]
        chunks = [x[a:e] for x, a, e in zip(ids, starts, ends)]
        firsts = logprobs.prefill_logit_starts(reqs, starts, ends)
        fb = self.runner.extend_batch(
            [r.row for r in reqs], chunks, starts, capture_hidden=self.capture, logit_starts=firsts
        )
        out = self.runner.forward(fb)
        assert out.logits is not None
        last, prompt_lps = logprobs.split_prefill_logits(out.logits, reqs, ends, firsts)
        logits_processor.sync(reqs)
        first, lps = sample_last(last, reqs, ends)
        logits_processor.commit(reqs, [[t] if t is not None else [] for t in first])
        nxt = [(x + ([t] if t is not None else []))[a + 1 : e + 1] for x, t, a, e in zip(ids, first, starts, ends)]
        t0 = time.perf_counter()
        self._draft_extend(reqs, nxt, starts, out.features)
        if self.policy is not None:  # the catch-up's cost, at many tokens
            self.sync_device()
            self.policy.observe_draft_extend(sum(map(len, nxt)), time.perf_counter() - t0)
        return [logprobs.prefill_output(t, e, lp, p) for t, e, lp, p in zip(first, ends, lps, prompt_lps)]

    # ---- draft model helpers ----------------------------------------------------------------------------------
    def _draft_topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k draft probabilities and their target token ids."""
        p, idx = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
        mapper = getattr(self.draft.model, "map_to_target_ids", None)
        return p, (mapper(idx) if mapper else idx)

    def _prune(self, logits: torch.Tensor, reqs: list[Req], paths: list[list[list[int]]]) -> torch.Tensor:
        """Draft logits [B * R, Vd] with the tokens each row's grammar forbids after its path set to -inf, so
        they never become tree nodes (verification alone keeps the output exact; this raises acceptance)."""
        allowed = logits_processor.allowed_tokens(reqs, paths, self.runner.config.vocab_size)
        if allowed is None:
            return logits
        mapper = getattr(self.draft.model, "map_to_target_ids", None)
        if mapper is not None:  # an EAGLE-3 draft vocabulary: draft id j proposes target id d2t(j)
            allowed = allowed[:, mapper(torch.arange(logits.shape[1], device=allowed.device))]
        else:
            allowed = allowed[:, : logits.shape[1]]
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def _draft_extend(
        self, reqs: list[Req], tokens: list[list[int]], prefix: list[int], features: torch.Tensor | None
    ) -> None:
        """Draft consumes (token at p+1, target feature at p) pairs; its last row seeds the next tree."""
        fb = self.draft.extend_batch([r.row for r in reqs], tokens, prefix, input_hidden=features)
        out = self.draft.forward(fb)
        assert out.logits is not None and fb.logits_indices is not None
        logits = out.logits
        if self.prune_drafts and logits_processor.constrained(reqs):  # the next tree's step 0 follows the history
            logits = self._prune(logits, reqs, [[[]] for _ in reqs])
        p, idx = self._draft_topk(logits, self.K_max)
        last = out.hidden[fb.logits_indices]
        for i, r in enumerate(reqs):
            committed = prefix[i] + len(tokens[i])
            self.states[r.rid] = SpecState(committed, tokens[i][-1], p[i], idx[i], last[i])

    # ---- one round ----------------------------------------------------------------------------------------------
    def _catch_up(self, reqs: list[Req]) -> int:
        """One draft extend over the tokens of the off rounds since each request's last one (docs/design.md,
        "Adaptive speculation": cheaper than a one-token extend per off round); how many tokens it took."""
        lag = [r for r in reqs if self.states[r.rid].catchup_tokens]
        if not lag:
            return 0
        states = [self.states[r.rid] for r in lag]
        tokens = [s.catchup_tokens for s in states]
        prefix = [s.committed - len(t) for s, t in zip(states, tokens)]
        feats = None
        if self.capture != CaptureHidden.NONE:
            feats = torch.stack([f for s in states for f in s.catchup_features])
        self._draft_extend(lag, tokens, prefix, feats)
        return sum(map(len, tokens))

    @torch.inference_mode()
    def run_off_round(self, reqs: list[Req], allocated: list[int]) -> list[StepOutput]:
        """OFF: one target decode of each root at position L, exactly as the plain worker would. The draft
        catches up lazily before the next speculative round (SpecState.catchup_tokens), or under
        TREEPAGE_OFF_DRAFT_SYNC=eager with a one-token draft extend now (benchmark/bench_off_round.py)."""
        states = [self.states[r.rid] for r in reqs]
        L = [s.committed for s in states]
        bad = [(r.rid, n + 1, a) for r, n, a in zip(reqs, L, allocated) if n + 1 > a]
        if bad:
            raise RuntimeError(f"off round would touch positions past the allocation: {bad[:4]}")
        fb = self.runner.extend_batch(
            [r.row for r in reqs],
            [[s.root] for s in states],
            L,
            ForwardMode.DECODE,
            capture_hidden=self.capture,
        )
        out = self.runner.forward(fb)
        assert out.logits is not None
        toks, lps = sample_reqs(out.logits, reqs)
        logits_processor.commit(reqs, [[t] for t in toks])
        outs = [StepOutput([t], n + 1, logprobs=[lp] if lp else None) for t, n, lp in zip(toks, L, lps)]
        if self.off_draft_sync == "eager":
            self._draft_extend(reqs, [[t] for t in toks], L, out.features)
            return outs
        for i, (s, t) in enumerate(zip(states, toks)):
            s.catchup_tokens.append(t)
            if out.features is not None:
                s.catchup_features.append(out.features[i])
            s.committed += 1
            s.root = t
        return outs

    @torch.inference_mode()
    def run_round(
        self, reqs: list[Req], allocated: list[int], shape: TreeShape | None = None
    ) -> list[StepOutput]:
        """`allocated`: each row's allocation as the scheduler reserved it for this round; `shape`: this round's
        tree (None: the configured one; OFF: a plain decode)."""
        shape = shape or self.shape
        if shape.is_off:
            return self.run_off_round(reqs, allocated)
        self._catch_up(reqs)
        K, S, N, P = shape.topk, shape.steps, shape.draft_tokens, self.P
        dev = self.device
        states = [self.states[r.rid] for r in reqs]
        B = len(reqs)
        rows = self._tensor([r.row for r in reqs])
        L_cpu = [s.committed for s in states]
        L = self._tensor(L_cpu)
        rtt = self.pools.req_to_token_pool.req_to_token
        layout = dl.compute_draft_layout(L, P, K, S)
        # Fail fast rather than read or write outside the request's allocation.
        touched = torch.maximum(dl.draft_region_end(layout), L + N).tolist()
        bad = [(r.rid, t, a) for r, t, a in zip(reqs, touched, allocated) if t > a]
        if bad:
            raise RuntimeError(f"speculative round would touch positions past the allocation: {bad[:4]}")
        out_loc = dl.draft_out_cache_loc(rtt, rows, layout)  # [B, K, S]
        if P > 1 and K > 1:
            dl.duplicate_prefix_tail_to_draft_branches(self.draft.kv_pool, rtt, rows, layout)

        # Draft: S steps grow the dynamic tree (S - 1 forwards; step 0 comes from the last draft extend).
        topk_p = torch.stack([s.topk_p[:K] for s in states])
        topk_index = torch.stack([s.topk_index[:K] for s in states])
        hidden0 = torch.stack([s.hidden for s in states])
        state, ids, hidden = draft_step_first(topk_p, topk_index, hidden0)
        # with a grammar, each frontier node's path (the drafted tokens from the root) prunes its children
        prune = self.prune_drafts and logits_processor.constrained(reqs)
        front = [[[t] for t in row] for row in topk_index.tolist()] if prune else []
        for i in range(1, S):
            fb = self.draft.make_batch(
                mode=ForwardMode.DRAFT_DECODE,
                input_ids=ids,
                positions=(L + i - 1).repeat_interleave(K),
                out_cache_loc=out_loc[:, :, i - 1].reshape(-1),
                req_rows=rows,
                cascade=dl.cascade_plan(rtt, rows, layout, i - 1),
                input_hidden=hidden,
            )
            out = self.draft.forward(fb)
            assert out.logits is not None
            h = out.hidden
            draft_logits = self._prune(out.logits, reqs, front) if prune else out.logits
            p, idx = self._draft_topk(draft_logits, K)
            if i < S - 1:
                ids, hidden = draft_step_next(i, state, p, idx, h)
                if prune:
                    assert state.last_parent_rows is not None
                    nxt = ids.view(B, K).tolist()
                    front = [
                        [front[b][r] + [t] for r, t in zip(parents, nxt[b])]
                        for b, parents in enumerate(state.last_parent_rows.tolist())
                    ]
                if K > 1 and state.last_parent_rows is not None:
                    self._regather_lanes(out_loc, state.last_parent_rows, i)
            else:
                draft_step_last(i, state, p, idx)
        roots = self._tensor([s.root for s in states])
        tree = build_tree(state, roots, L, N, K, S)

        # Verify: the target runs the N tree tokens in the window [L, L+N) under the tree mask.
        win = L[:, None] + torch.arange(N, device=dev)[None, :]
        fb = self.runner.make_batch(
            mode=ForwardMode.TARGET_VERIFY,
            input_ids=tree.draft_tokens.reshape(-1),
            positions=tree.positions.reshape(-1),
            out_cache_loc=rtt[rows[:, None], win].reshape(-1),
            req_rows=rows,
            prefix_lens=L_cpu,
            extend_lens=[N] * B,
            tree_mask=tree.tree_mask,
            capture_hidden=self.capture,
        )
        verified = self.runner.forward(fb)
        logits, features = verified.logits, verified.features
        assert logits is not None
        if any(r.logits_processor is not None for r in reqs):
            logits = logits_processor.process_logits(logits, reqs, [tree.node_paths(b) for b in range(B)])
        res = self._verify(reqs, tree, logits, S)
        a = res.accept_len
        a_cpu = a.tolist()

        # Move the accepted path's target KV to [L, L + accept_len).
        j = torch.arange(S + 1, device=dev)[None, :]
        valid = j < a[:, None]
        nodes = res.accepted_nodes.clamp(min=0)
        move = valid & (nodes != j)
        if bool(move.any()):
            src = rtt[rows[:, None], L[:, None] + nodes][move]
            dst = rtt[rows[:, None], L[:, None] + j][move]
            self.runner.kv_pool.move_kv_cache(dst, src)

        # Draft extend over the accepted pairs, then commit.
        predict = res.predict
        tokens = [predict[b, : a_cpu[b]].tolist() for b in range(B)]
        feats = features[res.accept_index[valid]] if features is not None else None
        logits_processor.commit(reqs, tokens)  # first: the draft extend prunes the next tree by the new history
        self._draft_extend(reqs, tokens, L_cpu, feats)
        self.debug.record(a_cpu, first_branch_of(tree, res.accepted_nodes).tolist())
        alt = self._subtree_accepts(reqs, tree, res.accepted_nodes, shape, a_cpu)
        outs = [
            StepOutput(t, x + n, verified=True, subtree_accept=d)
            for t, x, n, d in zip(tokens, L_cpu, a_cpu, alt)
        ]
        if logprobs.wanted(reqs):
            self._path_logprobs(reqs, outs, logits, res.accept_index)
        return outs

    def _subtree_accepts(
        self,
        reqs: list[Req],
        tree: EagleTree,
        accepted_nodes: torch.Tensor,
        shape: TreeShape,
        accept: list[int],
    ) -> list[dict[str, int] | None]:
        """Per greedy request, what this shape emitted and what ONE_DRAFT and each smaller candidate would have
        (subtree_accept_len), whenever the worker has several shapes: the adaptive policy learns from rounds it did
        not run, and the start-up calibration reads every contained shape's prior off the largest one's rounds."""
        if len(self.shapes) < 2:
            return [None] * len(reqs)
        smaller = list(dict.fromkeys(c for c in [ONE_DRAFT, *sub_shapes(self.shapes, shape)] if c != shape))
        cols = [subtree_accept_len(tree, accepted_nodes, c.steps, c.topk, c.draft_tokens) for c in smaller]
        table = torch.stack(cols, dim=1).tolist() if cols else [[] for _ in reqs]
        return [
            {shape.label: a} | {c.label: n for c, n in zip(smaller, row)} if r.sampling.greedy else None
            for r, row, a in zip(reqs, table, accept)
        ]

    @staticmethod
    def _path_logprobs(
        reqs: list[Req], outs: list[StepOutput], logits: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """The target's logprobs of the emitted tokens: the j-th comes from the verify row of the accepted path's
        j-th node (the processed logits the round chose from), as a plain decode step would compute it."""
        ask = [b for b, r in enumerate(reqs) if r.logprob is not None]
        picked = torch.cat([rows[b, : len(outs[b].tokens)] for b in ask])
        entries = logprobs.token_logprobs(
            logits[picked],
            [reqs[b] for b in ask for _ in outs[b].tokens],
            [t for b in ask for t in outs[b].tokens],
        )
        for b in ask:
            n = len(outs[b].tokens)
            outs[b].logprobs, entries = entries[:n], entries[n:]

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.int64, device=self.device)

    def _regather_lanes(self, out_loc: torch.Tensor, parent_rows: torch.Tensor, step: int) -> None:
        """Give frontier row k the draft KV of its own ancestors: lane k's steps [0, step) := lane parent_rows[k]'s.

        The frontier is re-ranked every step, so row k may descend from another lane; without this copy it would
        attend a different branch's history (a draft-quality loss, never a correctness one). The copy touches
        only the branches' own chain slots, never the duplicated prefix tail.
        """
        B, K, _ = out_loc.shape
        lanes = torch.arange(K, device=out_loc.device)[None, :]
        if bool((parent_rows == lanes).all()):
            return
        src = out_loc[torch.arange(B, device=out_loc.device)[:, None], parent_rows, :step]  # [B, K, step]
        dst = out_loc[:, :, :step]
        self.draft.kv_pool.move_kv_cache(dst.reshape(-1), src.reshape(-1))

    def _verify(self, reqs: list[Req], tree: EagleTree, logits: torch.Tensor, S: int) -> VerifyResult:
        if self.fixed_accept is not None:
            return self._fixed_accept(tree, logits, S)
        if all(r.sampling.greedy for r in reqs):
            return verify_tree_greedy(tree, logits, S)
        dev = logits.device
        sp = [r.sampling for r in reqs]
        temps = torch.tensor([0.0 if s.greedy else s.temperature for s in sp], device=dev)
        top_ps = torch.tensor([s.top_p for s in sp], device=dev)
        top_ks = torch.tensor([s.top_k for s in sp], device=dev)
        gens = [r.generator for r in reqs]
        return verify_tree_sampling(tree, logits, temps, top_ps, top_ks, S, generator=gens)

    def _fixed_accept(self, tree: EagleTree, logits: torch.Tensor, S: int) -> VerifyResult:
        """Debug knob: accept the first-child chain to a fixed depth regardless of the target."""
        B, N = tree.draft_tokens.shape
        want = self.fixed_accept
        assert want is not None
        nodes = torch.full((B, S + 1), -1, dtype=torch.int64, device=logits.device)
        nodes[:, 0] = 0
        cur = torch.zeros(B, dtype=torch.int64, device=logits.device)
        alen = torch.ones(B, dtype=torch.int64, device=logits.device)
        for d in range(1, want):
            nxt = tree.retrieve_next_token.gather(1, cur[:, None])[:, 0]
            ok = nxt >= 0
            cur = torch.where(ok, nxt, cur)
            nodes[:, d] = torch.where(ok & (alen == d), nxt, nodes[:, d])
            alen = torch.where(ok & (alen == d), alen + 1, alen)
        argmax = logits.view(B, N, -1).argmax(-1)
        predict = torch.full_like(nodes, -1)
        for d in range(S + 1):
            node = nodes[:, d]
            tok = tree.draft_tokens.gather(1, node.clamp(min=0)[:, None])[:, 0]
            bonus = argmax.gather(1, node.clamp(min=0)[:, None])[:, 0]
            if d >= 1:
                predict[:, d - 1] = torch.where(node >= 0, tok, predict[:, d - 1])
            predict[:, d] = torch.where((node >= 0) & (alen == d + 1), bonus, predict[:, d])
        base = torch.arange(B, device=logits.device)[:, None] * N
        return VerifyResult(torch.where(nodes >= 0, base + nodes, -1), alen, predict, nodes)
