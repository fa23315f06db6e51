from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from treepage.layers.sampler import target_probs_from_logits
from treepage.speculative.eagle_tree import (
    EagleTree,
    build_tree,
    chain_tree,
    draft_step_first,
    draft_step_last,
    draft_step_next,
)
from treepage.speculative.eagle_verify import (
    VerifyResult,
    chain_accept_lens,
    first_branch_of,
    rebuilt_subtree_accept_len,
    subtree_accept_len,
    verify_tree_greedy,
    verify_tree_sampling,
)

# chi-square critical values at p = 0.001 for 1..10 degrees of freedom
CHI2_CRIT_0001 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588]


def _tree_from_steps(steps, root: torch.Tensor, n: int, seq_len: int = 10) -> EagleTree:
    """Draft a tree from explicit per-step (probs, tokens) of one request, repeated over the batch."""
    bs = root.shape[0]
    k = len(steps[0][0])

    def rep(x, rows):
        return torch.as_tensor(x).reshape(rows, k).repeat(bs, 1)

    state, _, _ = draft_step_first(rep(steps[0][0], 1).float(), rep(steps[0][1], 1), torch.zeros(bs, 1))
    for i, (p, t) in enumerate(steps[1:], start=1):
        if i < len(steps) - 1:
            draft_step_next(i, state, rep(p, k).float(), rep(t, k), torch.zeros(bs * k, 1))
        else:
            draft_step_last(i, state, rep(p, k).float(), rep(t, k))
    return build_tree(state, root, torch.full((bs,), seq_len), n, k, len(steps))


def _random_tree(bs: int, k: int, s: int, n: int, vocab: int, seed: int) -> EagleTree:
    g = torch.Generator().manual_seed(seed)

    def topk(rows):
        p = (
            torch.softmax(torch.randn(rows, vocab, generator=g), dim=1)[:, :k]
            .sort(dim=1, descending=True)
            .values
        )
        return p, torch.rand(rows, vocab, generator=g).argsort(dim=1)[:, :k]

    state, _, _ = draft_step_first(*topk(bs), torch.zeros(bs, 1))
    for i in range(1, s):
        if i < s - 1:
            draft_step_next(i, state, *topk(bs * k), torch.zeros(bs * k, 1))
        else:
            draft_step_last(i, state, *topk(bs * k))
    root = torch.randint(0, vocab, (bs,), generator=g)
    return build_tree(state, root, torch.randint(0, 100, (bs,), generator=g), n, k, s)


def _children(parent: list[int]) -> dict[int, list[int]]:
    return {c: [m for m in range(len(parent)) if parent[m] == c] for c in range(len(parent))}


def _brute_greedy(
    tokens: list[int], parent: list[int], argmax: list[int], s: int
) -> tuple[list[int], list[int]]:
    kids = _children(parent)
    path, cur = [0], 0
    for _ in range(s):
        nxt = next((m for m in kids[cur] if tokens[m] == argmax[cur]), None)
        if nxt is None:
            break
        path.append(nxt)
        cur = nxt
    return path, [tokens[m] for m in path[1:]] + [argmax[cur]]


def _check_consistent(tree: EagleTree, res: VerifyResult, s: int, max_rows: int = 256) -> None:
    bs, n = tree.draft_tokens.shape
    assert res.accept_index.shape == res.predict.shape == res.accepted_nodes.shape == (bs, s + 1)
    assert ((res.accept_len >= 1) & (res.accept_len <= s + 1)).all()
    for b in range(min(bs, max_rows)):
        a = int(res.accept_len[b])
        nodes = res.accepted_nodes[b].tolist()
        assert nodes[0] == 0 and all(x >= 0 for x in nodes[:a]) and all(x == -1 for x in nodes[a:])
        assert all(tree.parent[b, nodes[j]] == nodes[j - 1] for j in range(1, a))
        assert res.accept_index[b].tolist() == [b * n + x for x in nodes[:a]] + [-1] * (s + 1 - a)
        assert res.predict[b, : a - 1].tolist() == [int(tree.draft_tokens[b, x]) for x in nodes[1:a]]
        assert res.predict[b, a - 1] >= 0 and (res.predict[b, a:] == -1).all()


@pytest.mark.parametrize("k,s,n", [(2, 3, 6), (4, 3, 16), (3, 5, 20), (1, 4, 5), (4, 2, 21)])
def test_greedy_matches_brute_force(k, s, n):
    bs, vocab = 64, 50
    tree = _random_tree(bs, k, s, n, vocab, seed=k * 100 + s)
    rng = random.Random(k * 7 + s)
    argmax = torch.randint(0, vocab, (bs, n), generator=torch.Generator().manual_seed(n))
    for b in range(bs):
        kids = _children(tree.parent[b].tolist())
        for c in range(n):
            if kids[c] and rng.random() < 0.8:  # force a match, often on a non-first sibling
                argmax[b, c] = tree.draft_tokens[b, rng.choice(kids[c])]
    res = verify_tree_greedy(tree, argmax, s)
    _check_consistent(tree, res, s)
    through_later_sibling = False
    for b in range(bs):
        parent = tree.parent[b].tolist()
        path, emitted = _brute_greedy(tree.draft_tokens[b].tolist(), parent, argmax[b].tolist(), s)
        assert res.accepted_nodes[b, : len(path)].tolist() == path
        assert int(res.accept_len[b]) == len(path)
        assert res.predict[b, : len(emitted)].tolist() == emitted
        kids = _children(parent)
        through_later_sibling |= any(kids[parent[m]][0] != m for m in path[1:])
    assert int(res.accept_len.max()) >= 3 and (through_later_sibling or k == 1)
    # the same verdict from logits, flat [B*N, V]
    logits = torch.randn(bs * n, vocab).scatter(1, argmax.view(-1, 1), 10.0)
    res_logits = verify_tree_greedy(tree, logits, s)
    assert torch.equal(res_logits.predict, res.predict) and torch.equal(
        res_logits.accept_index, res.accept_index
    )


def test_mixed_batch_greedy_rows_equal_greedy_verify():
    k, s, n, vocab = 4, 3, 12, 30
    bs = 48
    tree = _random_tree(bs, k, s, n, vocab, seed=3)
    logits = torch.randn(bs, n, vocab)
    rng = random.Random(0)
    for b in range(bs):
        kids = _children(tree.parent[b].tolist())
        for c in range(n):
            if kids[c] and rng.random() < 0.8:
                logits[b, c, tree.draft_tokens[b, rng.choice(kids[c])]] += 8.0
    temps = torch.tensor([0.0, 1.0, 0.0, 0.7] * (bs // 4))
    top_ks = torch.tensor([-1, 5, 3, -1] * (bs // 4))
    top_ps = torch.tensor([1.0, 0.9, 0.5, 1.0] * (bs // 4))
    g = torch.Generator().manual_seed(1)
    res = verify_tree_sampling(tree, logits.view(bs * n, vocab), temps, top_ps, top_ks, s, generator=g)
    _check_consistent(tree, res, s)
    ref = verify_tree_greedy(tree, logits.view(bs * n, vocab), s)
    greedy = temps == 0
    for name in ("accept_index", "accept_len", "predict", "accepted_nodes"):
        assert torch.equal(getattr(res, name)[greedy], getattr(ref, name)[greedy])
    assert int(ref.accept_len[greedy].max()) >= 3


def test_per_request_generators_make_a_row_independent_of_its_batch():
    """With one generator per request, a seeded row draws the same tokens alone or next to other requests."""
    k, s, n, vocab = 4, 3, 12, 30
    bs = 6
    tree = _random_tree(bs, k, s, n, vocab, seed=5)
    logits = torch.randn(bs, n, vocab)
    temps, top_ps, top_ks = torch.full((bs,), 0.9), torch.ones(bs), torch.full((bs,), -1)
    gens = [torch.Generator().manual_seed(100 + b) for b in range(bs)]
    batch = verify_tree_sampling(tree, logits.view(bs * n, vocab), temps, top_ps, top_ks, s, generator=gens)
    _check_consistent(tree, batch, s)
    for b in range(bs):
        one = EagleTree(*(getattr(tree, f.name)[b : b + 1] for f in dataclasses.fields(EagleTree)))
        alone = verify_tree_sampling(
            one,
            logits[b],
            temps[:1],
            top_ps[:1],
            top_ks[:1],
            s,
            generator=[torch.Generator().manual_seed(100 + b)],
        )
        assert torch.equal(alone.predict[0], batch.predict[b]) and int(alone.accept_len[0]) == int(
            batch.accept_len[b]
        )


def _toy_hash(parent: int, token: int) -> int:
    return (parent * 1000003 + token + 1) % 2147483647


def _toy_children(h: int, k: int, vocab: int) -> tuple[list[float], list[int]]:
    """The toy draft's top-k after the path hashed to h: peaked, as a trained draft's are."""
    rng = random.Random(h)
    w = sorted((rng.random() ** 6 for _ in range(vocab)), reverse=True)
    return [x / sum(w) for x in w[:k]], rng.sample(range(vocab), vocab)[:k]


def _path_draft(roots: list[int], k: int, s: int, n: int, vocab: int) -> EagleTree:
    """A tree drafted by a path-dependent toy draft: a node's top-k children are a function of its whole path
    (the `hidden` of every row carries a hash of it), as a real draft's are, so trees of different shapes
    drafted from the same roots share every node they have in common."""

    def forward(ids: torch.Tensor, parent_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = [_toy_hash(a, b) for a, b in zip(parent_h.tolist(), ids.tolist())]
        rows = [_toy_children(x, k, vocab) for x in h]
        return torch.tensor([p for p, _ in rows]), torch.tensor([t for _, t in rows]), torch.tensor(h)

    hidden = torch.tensor([_toy_hash(0, r) for r in roots])
    first = [_toy_children(x, k, vocab) for x in hidden.tolist()]
    state, ids, h = draft_step_first(
        torch.tensor([p for p, _ in first]), torch.tensor([t for _, t in first]), hidden
    )
    for i in range(1, s):
        p, t, h_out = forward(ids, h)
        if i < s - 1:
            ids, h = draft_step_next(i, state, p, t, h_out)
        else:
            draft_step_last(i, state, p, t)
    return build_tree(state, torch.tensor(roots), torch.full((len(roots),), 10), n, k, s)


def _toy_target(tree: EagleTree, vocab: int) -> torch.Tensor:
    """[B, N] argmax of a toy target that is a function of the path too: the draft's top token 70 % of the time."""
    out = []
    for b in range(tree.draft_tokens.shape[0]):
        row = []
        for path in tree.node_paths(b):
            h = _toy_hash(0, int(tree.draft_tokens[b, 0]))
            for t in path:
                h = _toy_hash(h, t)
            rng = random.Random(-h)
            row.append(_toy_children(h, 1, vocab)[1][0] if rng.random() < 0.7 else rng.randrange(vocab))
        out.append(row)
    return torch.tensor(out)


@pytest.mark.parametrize(
    "served,smaller",
    [((4, 4, 16), (3, 2, 6)), ((4, 4, 16), (3, 1, 4)), ((4, 4, 16), (1, 1, 2)), ((4, 4, 16), (4, 4, 16)),
     ((3, 2, 6), (3, 1, 4)), ((4, 4, 16), (2, 4, 8)), ((5, 3, 14), (4, 2, 7))],
)  # fmt: skip
def test_subtree_accept_len_is_what_the_smaller_round_would_have_emitted(served, smaller):
    """Against the smaller shape's own round: its tree drafted from the same (path-dependent) draft and verified
    greedily by the same target. Equal whenever that tree lies inside the served one (always for the shape
    itself, and in most rounds here), never more."""
    (S, K, N), (s2, k2, n2) = served, smaller
    bs, vocab = 96, 12
    roots = list(range(bs))
    big, small = _path_draft(roots, K, S, N, vocab), _path_draft(roots, k2, s2, n2, vocab)
    accepted = verify_tree_greedy(big, _toy_target(big, vocab), S).accepted_nodes
    got = subtree_accept_len(big, accepted, s2, k2, n2).tolist()
    want = verify_tree_greedy(small, _toy_target(small, vocab), s2).accept_len.tolist()
    inside = [set(map(tuple, small.node_paths(b))) <= set(map(tuple, big.node_paths(b))) for b in range(bs)]
    for b in range(bs):
        assert got[b] <= want[b]
        if inside[b]:
            assert got[b] == want[b], b
    assert sum(inside) >= 0.3 * bs, sum(inside)
    assert (
        max(want) >= min(3, s2 + 1) and min(want) == 1
    )  # the target accepts long paths and rejects at the root
    if smaller == served:
        assert all(inside)


def test_target_probs_from_logits():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 6)
    logits = p.log()
    temps = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    top_ps = torch.tensor([0.7, 0.81, 1.0, 0.5, 0.1, 1.0])
    top_ks = torch.tensor([-1, 0, 3, 2, -1, 100])
    out = target_probs_from_logits(logits, temps, top_ps, top_ks)
    sharp = p[0] ** 2 / (p[0] ** 2).sum()
    expected = torch.tensor(
        [
            [0.625, 0.375, 0.0, 0.0],  # top-p 0.7 keeps the first two
            [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0],  # top-p 0.81 needs a third token
            [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0],  # top-k 3
            [1.0, 0.0, 0.0, 0.0],  # top-k 2 -> [0.625, 0.375], then top-p 0.5 keeps one
            [1.0, 0.0, 0.0, 0.0],  # greedy
            sharp.tolist(),  # temperature 0.5 squares the probabilities
        ]
    )
    assert torch.allclose(out, expected, atol=1e-6)


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Pearson chi-square goodness of fit at p = 0.001; zero-probability tokens must never occur."""
    total = int(counts.sum())
    assert total >= 500
    assert int(counts[probs == 0].sum()) == 0
    keep = probs > 0
    exp = probs[keep].double() * total
    assert float(exp.min()) >= 5
    stat = float(((counts[keep].double() - exp) ** 2 / exp).sum())
    df = int(keep.sum()) - 1
    assert stat < CHI2_CRIT_0001[df - 1], (
        f"chi2={stat:.2f} df={df} counts={counts.tolist()} p={probs.tolist()}"
    )


def _check_distribution(tree, node_probs, logits, temps, top_ps, top_ks, s, seed):
    """First token ~ p_root; second token given an accepted first child c ~ p_c; otherwise one token only."""
    bs, n = tree.draft_tokens.shape
    vocab = logits.shape[-1]
    res = verify_tree_sampling(
        tree, logits, temps, top_ps, top_ks, s, generator=torch.Generator().manual_seed(seed)
    )
    _check_consistent(tree, res, s)
    first = res.predict[:, 0]
    _chi2_ok(torch.bincount(first, minlength=vocab), node_probs[0])
    kids = {int(tree.draft_tokens[0, m]): m for m in range(1, n) if tree.parent[0, m] == 0}
    assert (res.accept_len[~torch.isin(first, torch.tensor(list(kids)))] == 1).all()
    tested = 0
    for tok, m in kids.items():
        given = first == tok
        if int(given.sum()) >= 1000:
            assert (res.accept_len[given] >= 2).all()
            _chi2_ok(torch.bincount(res.predict[given, 1], minlength=vocab), node_probs[m])
            tested += 1
    assert tested >= 1
    return res


def _fixed_k4_tree(bs: int) -> EagleTree:
    steps = [
        ([0.4, 0.3, 0.2, 0.1], [0, 1, 2, 3]),
        (
            [[0.5, 0.3, 0.1, 0.1], [0.6, 0.2, 0.1, 0.1], [0.25] * 4, [0.25] * 4],
            [[4, 5, 6, 7], [0, 2, 4, 6], [1, 3, 5, 7], [0, 1, 2, 4]],
        ),
    ]
    tree = _tree_from_steps(steps, torch.zeros(bs, dtype=torch.int64), n=7)
    # root -> {0, 1, 2}; node(0) -> {4, 5}; node(1) -> {0}
    assert tree.draft_tokens[0].tolist() == [0, 0, 1, 2, 4, 5, 0]
    assert tree.parent[0].tolist() == [-1, 0, 0, 0, 1, 1, 2]
    return tree


NODE_P = torch.tensor(
    [
        [0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02],  # root: drafted children 0, 1, 2 cover 65%
        [0.05, 0.05, 0.10, 0.10, 0.40, 0.20, 0.05, 0.05],  # node 1 (token 0): children 4, 5
        [0.50, 0.10, 0.10, 0.10, 0.05, 0.05, 0.05, 0.05],  # node 2 (token 1): child 0
        [0.10, 0.10, 0.10, 0.30, 0.10, 0.10, 0.10, 0.10],  # node 3 (token 2): leaf
        [0.125] * 8,
        [0.20, 0.05, 0.05, 0.30, 0.10, 0.10, 0.10, 0.10],
        [0.05, 0.05, 0.05, 0.05, 0.20, 0.20, 0.20, 0.20],
    ]
)


def test_sampling_preserves_target_distribution_k4():
    bs = 20000
    tree = _fixed_k4_tree(bs)
    logits = NODE_P.log().repeat(bs, 1)
    ones = torch.ones(bs)
    _check_distribution(tree, NODE_P, logits, ones, ones, torch.full((bs,), -1), 2, seed=0)


def test_sampling_preserves_target_distribution_with_temperature_and_top_k():
    bs = 20000
    tree = _fixed_k4_tree(bs)
    node_logits = NODE_P.log().clone()
    node_logits[0] = torch.tensor([0.30, 0.05, 0.15, 0.10, 0.25, 0.08, 0.05, 0.02]).log()  # top-3: 0, 4, 2
    temp, top_k = 0.7, 3
    expected = torch.softmax(node_logits / temp, dim=1)
    cut = expected.sort(dim=1, descending=True).values[:, top_k - 1 : top_k]
    expected = torch.where(expected >= cut, expected, 0.0)
    expected = expected / expected.sum(1, keepdim=True)
    logits = node_logits.repeat(bs, 1)
    temps, top_ps, top_ks = torch.full((bs,), temp), torch.ones(bs), torch.full((bs,), top_k)
    probs = target_probs_from_logits(node_logits, temps[:7], top_ps[:7], top_ks[:7])
    assert torch.allclose(probs, expected, atol=1e-6)
    _check_distribution(tree, expected, logits, temps, top_ps, top_ks, 2, seed=1)


def test_sampling_preserves_target_distribution_k1_chain():
    bs, vocab, s = 20000, 6, 3
    chain = torch.tensor([[2, 0, 5]]).repeat(bs, 1)
    tree = chain_tree(torch.zeros(bs, dtype=torch.int64), chain, torch.full((bs,), 4))
    node_p = torch.tensor(
        [
            [0.20, 0.10, 0.30, 0.15, 0.15, 0.10],
            [0.40, 0.10, 0.10, 0.10, 0.20, 0.10],
            [0.10, 0.10, 0.10, 0.10, 0.10, 0.50],
            [0.30, 0.20, 0.10, 0.10, 0.20, 0.10],
        ]
    )
    ones = torch.ones(bs)
    res = _check_distribution(
        tree, node_p, node_p.log().repeat(bs, 1), ones, ones, torch.zeros(bs), s, seed=2
    )
    # third token given the first two accepted drafts (2, 0) ~ p at node 2
    given = (res.predict[:, 0] == 2) & (res.predict[:, 1] == 0)
    _chi2_ok(torch.bincount(res.predict[given, 2], minlength=vocab), node_p[2])


def test_drafts_matching_target_raise_acceptance():
    bs, vocab, k, s = 4000, 16, 2, 3
    tree = _random_tree(bs, k, s, 7, vocab - 1, seed=5)  # token vocab-1 is never drafted
    nxt = tree.retrieve_next_token
    n = tree.num_nodes
    ones = torch.ones(bs)

    def mean_accept(peak_tokens: torch.Tensor) -> float:
        logits = torch.zeros(bs, n, vocab).scatter(2, peak_tokens.unsqueeze(2), 5.0)
        res = verify_tree_sampling(
            tree, logits.view(-1, vocab), ones, ones, torch.zeros(bs), s, torch.Generator().manual_seed(3)
        )
        return float(res.accept_len.float().mean())

    first_child_tok = tree.draft_tokens.gather(1, nxt.clamp(min=0))
    aligned = torch.where(nxt >= 0, first_child_tok, vocab - 1)
    off = torch.full_like(aligned, vocab - 1)
    hit, miss = mean_accept(aligned), mean_accept(off)
    assert hit > miss + 1.0, (hit, miss)
    p_peak = math.e**5 / (math.e**5 + vocab - 1)
    assert hit > 1 + p_peak  # at least the first level accepts with probability >= p_peak


def test_first_branch_of():
    steps = [
        ([0.6, 0.35], [10, 11]),
        ([[0.5, 0.2], [0.9, 0.05]], [[20, 21], [22, 23]]),
        ([[0.5, 0.4], [0.8, 0.1]], [[30, 31], [32, 33]]),
    ]
    tree = _tree_from_steps(steps, torch.tensor([5, 5, 5]), n=6)
    argmax = torch.full((3, 6), 99)
    argmax[0, 0] = 11  # root -> B (node 2, second sibling) -> B1 (node 4)
    argmax[0, 2] = 22
    argmax[1, 0] = 10  # root -> A (node 1)
    res = verify_tree_greedy(tree, argmax, 3)
    assert res.accepted_nodes[:, :3].tolist() == [[0, 2, 4], [0, 1, -1], [0, -1, -1]]
    assert res.predict.tolist() == [[11, 22, 99, -1], [10, 99, -1, -1], [99, -1, -1, -1]]
    assert first_branch_of(tree, res.accepted_nodes).tolist() == [1, 0, -1]


@pytest.mark.parametrize("served", [(4, 4, 16), (3, 2, 6), (5, 3, 14), (3, 1, 4), (1, 1, 2)])
def test_chain_accept_lens_count_every_chain_as_rebuilding_its_tree_does(served):
    """The chains' counterfactuals in one pass (what ONE_DRAFT's costs every round, and what subtree_accept_len
    answers chains with) agree with rebuilding each chain's tree inside the served one, over rounds that accept at
    every depth and reject at the root."""
    S, K, N = served
    big = _path_draft(list(range(96)), K, S, N, 12)
    accepted = verify_tree_greedy(big, _toy_target(big, 12), S).accepted_nodes
    chains = chain_accept_lens(big, accepted)
    assert chains.shape == (96, S)
    for j in range(S):
        assert chains[:, j].tolist() == rebuilt_subtree_accept_len(big, accepted, j + 1, 1, j + 2).tolist(), j
    assert chains[:, 0].min() == 1 and chains[:, 0].max() == 2 and chains[:, -1].max() >= min(S + 1, 4)
