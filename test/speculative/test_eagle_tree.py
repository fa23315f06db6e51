from __future__ import annotations

import math

import pytest
import torch

from treepage.speculative.eagle_tree import (
    DraftStepState,
    EagleTree,
    build_tree,
    chain_tree,
    draft_step_first,
    draft_step_last,
    draft_step_next,
)

H = 2  # hidden width; row r of every fake forward output holds the value r so gathers are checkable


def _topk_rows(
    rows: int, k: int, vocab: int, g: torch.Generator, ties: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake draft top-K: distinct tokens per row, probabilities descending (equal ones when `ties`)."""
    tokens = torch.rand(rows, vocab, generator=g).argsort(dim=1)[:, :k]
    if ties:
        p = torch.randint(1, 3, (rows, k), generator=g).float() / (2 * k)
    else:
        p = torch.softmax(torch.randn(rows, vocab, generator=g) * 2, dim=1)[:, :k]
    return p.sort(dim=1, descending=True).values, tokens


def _draft(bs: int, k: int, s: int, vocab: int, seed: int, ties: bool = False):
    """Run the step loop on fake forwards; returns the state and the raw per-step inputs/outputs."""
    g = torch.Generator().manual_seed(seed)
    p0, t0 = _topk_rows(bs, k, vocab, g, ties)
    state, ids, hid = draft_step_first(p0, t0, torch.arange(bs).float().unsqueeze(1).expand(bs, H))
    raw = [(p0, t0)]
    frontier_inputs = [(ids, hid, state.last_parent_rows.clone())]
    for i in range(1, s):
        p, t = _topk_rows(bs * k, k, vocab, g, ties)
        raw.append((p, t))
        if i < s - 1:
            out = torch.arange(bs * k).float().unsqueeze(1).expand(bs * k, H)
            ids, hid = draft_step_next(i, state, p, t, out)
            frontier_inputs.append((ids, hid, state.last_parent_rows.clone()))
        else:
            draft_step_last(i, state, p, t)
    return state, raw, frontier_inputs


def _reference(state: DraftStepState, raw, k: int, s: int, n: int):
    """EAGLE-2 selection written plainly per request, ordering by the recorded scores and (-score, flat)."""
    scores = torch.cat(state.score_list, dim=1).tolist()
    bs = len(scores)
    out = []
    for b in range(bs):
        sc = scores[b]
        cand = {}  # flat -> (parent flat, token, depth, exact cumulative log-prob)
        p0, t0 = raw[0]
        for j in range(k):
            cand[j] = (-1, int(t0[b, j]), 1, math.log(float(p0[b, j])))
        frontier, frontiers = list(range(k)), []
        for i in range(1, s):
            p, t = raw[i]
            new = []
            for r, pf in enumerate(frontier):
                for c in range(k):
                    flat = k + (i - 1) * k * k + r * k + c
                    lp = cand[pf][3] + math.log(float(p[b * k + r, c]))
                    cand[flat] = (pf, int(t[b * k + r, c]), i + 1, lp)
                    new.append(flat)
            if i < s - 1:
                frontier = sorted(new, key=lambda f: (-sc[f], f))[:k]
                frontiers.append(frontier)
        for f, (_, _, _, lp) in cand.items():
            assert sc[f] == pytest.approx(lp, abs=1e-4)
        sel = sorted(sorted(cand, key=lambda f: (-sc[f], f))[: n - 1])
        node_of = {f: m + 1 for m, f in enumerate(sel)}
        parents = [-1] + [0 if cand[f][0] < 0 else node_of[cand[f][0]] for f in sel]
        out.append(([cand[f][1] for f in sel], parents, [0] + [cand[f][2] for f in sel], frontiers))
    return out


def _check_invariants(tree: EagleTree, seq_lens: torch.Tensor, s: int) -> None:
    bs, n = tree.draft_tokens.shape
    for b in range(bs):
        par = tree.parent[b].tolist()
        dep = tree.depth[b].tolist()
        assert par[0] == -1 and dep[0] == 0
        for m in range(1, n):
            assert 0 <= par[m] < m
            assert dep[m] == dep[par[m]] + 1 <= s
        assert tree.positions[b].tolist() == [int(seq_lens[b]) + d for d in dep]
        assert tree.retrieve_index[b].tolist() == [b * n + m for m in range(n)]
        for m in range(n):
            anc, a = {m}, m
            while par[a] >= 0:
                a = par[a]
                anc.add(a)
            assert tree.tree_mask[b, m].tolist() == [j in anc for j in range(n)]
            kids = [j for j in range(n) if par[j] == m]
            assert tree.retrieve_next_token[b, m] == (kids[0] if kids else -1)
            sibs = [j for j in range(m + 1, n) if par[j] == par[m]] if m > 0 else []
            assert tree.retrieve_next_sibling[b, m] == (sibs[0] if sibs else -1)


def _worked_example_state(bs: int = 1):
    def rep(x):
        return torch.tensor(x).repeat(bs, 1)

    state, ids, hid = draft_step_first(rep([[0.6, 0.35]]), rep([[10, 11]]), torch.ones(bs, H))
    assert ids.tolist() == [10, 11] * bs
    out0 = torch.arange(bs * 2).float().unsqueeze(1).expand(bs * 2, H)
    ids, hid = draft_step_next(1, state, rep([[0.5, 0.2], [0.9, 0.05]]), rep([[20, 21], [22, 23]]), out0)
    assert ids.tolist() == [22, 20] * bs  # frontier F_1 = [B1, A1]
    assert hid[:, 0].tolist() == [r for b in range(bs) for r in (2 * b + 1, 2 * b)]  # states of B, A
    assert state.parent_list[1].tolist() == [[4, 2]] * bs
    assert state.last_parent_rows.tolist() == [[1, 0]] * bs
    draft_step_last(2, state, rep([[0.5, 0.4], [0.8, 0.1]]), rep([[30, 31], [32, 33]]))
    return state


def test_worked_example():
    state = _worked_example_state(bs=2)
    assert torch.allclose(state.score_list[1].exp(), torch.tensor([[0.30, 0.12, 0.315, 0.0175]] * 2))
    seq_lens = torch.tensor([100, 7])
    tree = build_tree(state, torch.tensor([5, 6]), seq_lens, num_draft_tokens=6, topk=2, num_steps=3)
    assert tree.draft_tokens.tolist() == [[5, 10, 11, 20, 22, 32], [6, 10, 11, 20, 22, 32]]
    assert tree.parent.tolist() == [[-1, 0, 0, 1, 2, 3]] * 2
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2, 3]] * 2
    assert tree.positions.tolist() == [[100, 101, 101, 102, 102, 103], [7, 8, 8, 9, 9, 10]]
    assert tree.retrieve_next_token.tolist() == [[1, 3, 4, 5, -1, -1]] * 2
    assert tree.retrieve_next_sibling.tolist() == [[-1, 2, -1, -1, -1, -1]] * 2
    assert tree.retrieve_index.tolist() == [list(range(6)), list(range(6, 12))]
    assert tree.tree_mask[0, 5].int().tolist() == [1, 1, 0, 1, 0, 1]  # A1a
    assert tree.tree_mask[0, 4].int().tolist() == [1, 0, 1, 0, 1, 0]  # B1
    assert tree.tree_mask[0, 0].int().tolist() == [1, 0, 0, 0, 0, 0]
    _check_invariants(tree, seq_lens, 3)


@pytest.mark.parametrize(
    "k,s,n,ties",
    [
        (2, 3, 6, False),
        (3, 4, 10, False),
        (4, 3, 37, False),  # N - 1 == K + (S-1)K^2: every candidate is in the tree
        (4, 3, 12, True),
        (5, 2, 8, True),
        (4, 1, 3, False),  # S == 1: only the step-0 candidates
        (3, 5, 16, True),
        (2, 6, 12, True),
    ],
)
def test_random_trees_match_reference(k, s, n, ties):
    bs = 5
    state, raw, frontier_inputs = _draft(bs, k, s, vocab=40, seed=1000 * k + 10 * s + n, ties=ties)
    seq_lens = torch.randint(0, 500, (bs,), generator=torch.Generator().manual_seed(s))
    root = torch.arange(bs) + 100
    tree = build_tree(state, root, seq_lens, num_draft_tokens=n, topk=k, num_steps=s)
    _check_invariants(tree, seq_lens, s)
    ref = _reference(state, raw, k, s, n)
    for b, (tokens, parents, depth, frontiers) in enumerate(ref):
        assert tree.draft_tokens[b].tolist() == [100 + b] + tokens
        assert tree.parent[b].tolist() == parents
        assert tree.depth[b].tolist() == depth
        for i, frontier in enumerate(frontiers, start=1):
            ids, hid, rows = frontier_inputs[i]
            local = [f - k - (i - 1) * k * k for f in frontier]
            assert rows[b].tolist() == [f // k for f in local]
            _, t = raw[i]
            assert ids.view(bs, k)[b].tolist() == [int(t[b * k + f // k, f % k]) for f in local]
            assert hid.view(bs, k, H)[b, :, 0].tolist() == [b * k + f // k for f in local]
    if ties:
        scores = torch.cat(state.score_list, dim=1)
        assert any(len(set(row)) < len(row) for row in scores.tolist())  # the case really has ties


@pytest.mark.parametrize("s", [1, 3, 5])
def test_chain_tree_for_topk_one(s):
    bs = 3
    state, raw, _ = _draft(bs, 1, s, vocab=30, seed=s)
    seq_lens = torch.tensor([0, 5, 63])
    root = torch.tensor([1, 2, 3])
    tree = build_tree(state, root, seq_lens, num_draft_tokens=s + 1, topk=1, num_steps=s)
    chain = torch.cat([t.view(bs, -1) for _, t in raw], dim=1)
    assert tree.draft_tokens.tolist() == torch.cat([root.unsqueeze(1), chain], dim=1).tolist()
    assert tree.parent.tolist() == [list(range(-1, s))] * bs
    _check_invariants(tree, seq_lens, s)
    direct = chain_tree(root, chain, seq_lens)
    assert torch.equal(direct.tree_mask, tree.tree_mask) and torch.equal(direct.positions, tree.positions)


def test_nan_scores_keep_the_tree_valid():
    k, s, n, bs = 3, 3, 10, 2
    g = torch.Generator().manual_seed(0)
    p0, t0 = _topk_rows(bs, k, 20, g, False)
    state, _, _ = draft_step_first(p0, t0, torch.zeros(bs, H))
    p1, t1 = _topk_rows(bs * k, k, 20, g, False)
    p1[0, 0] = float("nan")
    draft_step_next(1, state, p1, t1, torch.zeros(bs * k, H))
    p2, t2 = _topk_rows(bs * k, k, 20, g, False)
    p2[:, 1] = float("nan")
    draft_step_last(2, state, p2, t2)
    seq_lens = torch.tensor([3, 4])
    tree = build_tree(state, torch.tensor([0, 0]), seq_lens, num_draft_tokens=n, topk=k, num_steps=s)
    _check_invariants(tree, seq_lens, s)
    assert not torch.isnan(torch.cat(state.score_list, dim=1)).any()


def test_bad_sizes_are_refused():
    state = _worked_example_state()
    with pytest.raises(ValueError, match="num_draft_tokens"):
        build_tree(state, torch.tensor([5]), torch.tensor([0]), num_draft_tokens=12, topk=2, num_steps=3)
    with pytest.raises(ValueError, match="num_steps"):
        build_tree(state, torch.tensor([5]), torch.tensor([0]), num_draft_tokens=6, topk=2, num_steps=4)
    chain_state, _, _ = _draft(1, 1, 3, vocab=10, seed=0)
    with pytest.raises(ValueError, match="topk=1"):
        build_tree(chain_state, torch.tensor([5]), torch.tensor([0]), num_draft_tokens=3, topk=1, num_steps=3)
