"""Tree verification: greedy walk and target-only tree speculative sampling (lossless), batched.

Both walks share one shape: each node gets a precomputed "would be accepted" flag, the first passing child of
every node (children in node order = sibling order) is found with one tensor op, and the walk from the root
is a pointer chase of S gathers. Only the last emitted token differs: the target argmax (greedy) or a draw from
the target distribution with the rejected siblings removed (sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from treepage.layers.sampler import target_probs_from_logits
from treepage.speculative.eagle_tree import EagleTree


@dataclass
class VerifyResult:
    """Per request: the accepted path (root first) and the tokens it emits. Index tensors are int64."""

    accept_index: Tensor  # [B, S+1] global rows b*N + node, -1 padded
    accept_len: Tensor  # [B] root + accepted drafts; equals the number of tokens emitted
    predict: Tensor  # [B, S+1] accepted drafts then the bonus token, -1 padded
    accepted_nodes: Tensor  # [B, S+1] local node ids, -1 padded


def _first_passing_child(parent: Tensor, passes: Tensor) -> Tensor:
    """[B, N]: for every node, the smallest-index child with passes == True, else -1."""
    n = parent.shape[1]
    idx = torch.arange(n, device=parent.device)
    hit = (parent.unsqueeze(1) == idx.view(1, n, 1)) & passes.unsqueeze(1)  # [B, node c, node m]
    first = torch.where(hit, idx.view(1, 1, n), n).amin(dim=2)
    return torch.where(first < n, first, -1)


def _walk(tree: EagleTree, passes: Tensor, num_steps: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Accepted nodes [B, S+1], accept_len [B], last node [B], and whether the walk stopped by rejection."""
    chosen = _first_passing_child(tree.parent, passes)
    bs = passes.shape[0]
    cur = torch.zeros(bs, dtype=torch.int64, device=passes.device)
    active = torch.ones(bs, dtype=torch.bool, device=passes.device)
    cols = [cur]
    for _ in range(num_steps):
        nxt = chosen.gather(1, cur.unsqueeze(1)).squeeze(1)
        active = active & (nxt >= 0)
        cur = torch.where(active, nxt, cur)
        cols.append(torch.where(active, nxt, -1))
    nodes = torch.stack(cols, dim=1)
    stopped = chosen.gather(1, cur.unsqueeze(1)).squeeze(1) < 0
    return nodes, (nodes >= 0).sum(1), cur, stopped


def _result(tree: EagleTree, nodes: Tensor, accept_len: Tensor, final_tokens: Tensor) -> VerifyResult:
    bs, n = tree.draft_tokens.shape
    drafts = nodes[:, 1:]
    tokens = tree.draft_tokens.gather(1, drafts.clamp(min=0)).to(torch.int64)
    pad = torch.full((bs, 1), -1, dtype=torch.int64, device=nodes.device)
    predict = torch.cat([torch.where(drafts >= 0, tokens, -1), pad], dim=1)
    predict.scatter_(1, (accept_len - 1).unsqueeze(1), final_tokens.to(torch.int64).unsqueeze(1))
    base = torch.arange(bs, device=nodes.device).unsqueeze(1) * n
    accept_index = torch.where(nodes >= 0, base + nodes, -1)
    return VerifyResult(
        accept_index=accept_index, accept_len=accept_len, predict=predict, accepted_nodes=nodes
    )


def verify_tree_greedy(tree: EagleTree, target: Tensor, num_steps: int) -> VerifyResult:
    """Accept, level by level, the first child equal to the target argmax; the bonus is the argmax at the end.

    `target` is either logits ([B*N, V] or [B, N, V], floating) or the argmax itself ([B, N], integer).
    """
    bs, n = tree.draft_tokens.shape
    if target.is_floating_point():
        target = target.reshape(bs * n, -1).argmax(-1)
    argmax = target.reshape(bs, n).to(torch.int64)
    at_parent = argmax.gather(1, tree.parent.clamp(min=0))
    passes = (tree.draft_tokens.to(torch.int64) == at_parent) & (tree.parent >= 0)
    nodes, accept_len, last, _ = _walk(tree, passes, num_steps)
    return _result(tree, nodes, accept_len, argmax.gather(1, last.unsqueeze(1)).squeeze(1))


def _sample(probs: Tensor, coin: Tensor) -> Tensor:
    """Inverse-CDF draw per row of unnormalised non-negative `probs` with one uniform coin per row."""
    cdf = probs.cumsum(-1)
    idx = (cdf <= coin.unsqueeze(1) * cdf[:, -1:]).sum(-1)
    vocab = probs.shape[-1]
    last_nonzero = vocab - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(-1)
    return torch.minimum(idx, last_nonzero)


def verify_tree_sampling(
    tree: EagleTree,
    target_logits: Tensor,
    temperatures: Tensor,
    top_ps: Tensor,
    top_ks: Tensor,
    num_steps: int,
    generator: torch.Generator | list[torch.Generator | None] | None = None,
) -> VerifyResult:
    """Target-only tree speculative sampling: every emitted token is an exact draw from the target.

    At node c with coin u_c, children are tried in sibling order and child x_j is accepted when
    u_c < sum_{i<=j} p_c(x_i) (an inverse-CDF line over p_c with the children first), so x_j is emitted with
    probability p_c(x_j). If none passes, the last token is drawn from p_c without the (all rejected)
    children, renormalised: total probability p_c(t) for every other t. Siblings must be distinct tokens,
    which holds for drafts taken from one top-K. Greedy rows (T = 0) are one-hot, hence exactly greedy.
    """
    bs, n = tree.draft_tokens.shape
    dev = tree.draft_tokens.device
    logits = target_logits.reshape(bs * n, -1)
    vocab = logits.shape[1]
    probs = target_probs_from_logits(
        logits, temperatures.repeat_interleave(n), top_ps.repeat_interleave(n), top_ks.repeat_interleave(n)
    ).view(bs, n, vocab)
    if isinstance(generator, list):  # one stream per request: a seeded request's draws ignore its batch-mates
        coins = torch.stack([torch.rand(n + 1, device=dev, generator=g) for g in generator])
    else:
        coins = torch.rand(bs, n + 1, device=dev, generator=generator)
    tokens = tree.draft_tokens.to(torch.int64)
    parent = tree.parent
    # p_node[m] = probability of node m's token under its parent's distribution
    p_node = probs.view(bs, n * vocab).gather(1, parent.clamp(min=0) * vocab + tokens)
    p_node = torch.where(parent >= 0, p_node, 0.0)
    idx = torch.arange(n, device=dev)
    earlier_sibling = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (idx.view(1, 1, n) <= idx.view(1, n, 1))
    acc = torch.einsum("bmj,bj->bm", earlier_sibling.float(), p_node)
    passes = (p_node > 0) & (coins[:, :n].gather(1, parent.clamp(min=0)) < acc) & (parent >= 0)
    nodes, accept_len, last, stopped = _walk(tree, passes, num_steps)
    # residual at the last node: its children were all rejected when the walk stopped there
    rejected = ((parent == last.unsqueeze(1)) & stopped.unsqueeze(1)).float()
    removed = torch.zeros(bs, vocab, device=dev).scatter_add_(1, tokens, rejected) > 0
    p_last = probs[torch.arange(bs, device=dev), last]
    residual = p_last.masked_fill(removed, 0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_last)  # rounding guard
    return _result(tree, nodes, accept_len, _sample(residual, coins[:, n]))


def first_branch_of(tree: EagleTree, accepted_nodes: Tensor) -> Tensor:
    """[B]: sibling rank (0..K-1) of the depth-1 node on the accepted path, -1 when no draft was accepted."""
    node = accepted_nodes[:, 1]
    n = tree.num_nodes
    earlier = (tree.depth == 1) & (torch.arange(n, device=node.device).unsqueeze(0) < node.unsqueeze(1))
    return torch.where(node >= 1, earlier.sum(1), -1)


def _best_of(member: Tensor, score: Tensor, k: int) -> Tensor:
    """[B, N] bool: the k best nodes of `member` by (-score, node index), as the draft tree ranks them."""
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    first = torch.sort(member.gather(1, order).to(torch.int8), dim=1, descending=True, stable=True).indices
    top = order.gather(1, first)[:, :k]
    return torch.zeros_like(member).scatter_(1, top, member.gather(1, top))


def chain_accept_lens(tree: EagleTree, accepted_nodes: Tensor) -> Tensor:
    """[B, S]: column j is what a greedy chain of j + 1 steps (topk 1) would have emitted from the same draft
    state: 1 + the accepted path's leading nodes that are each their parent's first child (the draft's most likely
    token there). The count rebuilding the chain's tree would give (rebuilt_subtree_accept_len), without rebuilding
    it: subtree_accept_len answers chains with it (the policy asks for ONE_DRAFT's every speculative round)."""
    path = accepted_nodes.clamp(min=0)
    first_child = tree.retrieve_next_token.gather(1, path[:, :-1])
    on_chain = (accepted_nodes[:, 1:] >= 0) & (first_child == accepted_nodes[:, 1:])
    return 1 + on_chain.to(torch.int64).cumprod(dim=1).cumsum(dim=1)


def subtree_accept_len(
    tree: EagleTree, accepted_nodes: Tensor, steps: int, topk: int, draft_tokens: int
) -> Tensor:
    """[B]: the tokens a greedy round of the smaller shape (steps, topk, draft_tokens) would have emitted from the
    same draft state, read off this round's tree and its greedy accepted path (`accepted_nodes`, [B, S+1]): for a
    chain no deeper than this round, its first-child path (chain_accept_lens: a few tensor ops, no tree to
    rebuild); else its tree rebuilt inside this one (rebuilt_subtree_accept_len)."""
    if topk == 1 and draft_tokens == steps + 1 and steps < accepted_nodes.shape[1]:
        return chain_accept_lens(tree, accepted_nodes)[:, steps - 1]
    return rebuilt_subtree_accept_len(tree, accepted_nodes, steps, topk, draft_tokens)


def rebuilt_subtree_accept_len(
    tree: EagleTree, accepted_nodes: Tensor, steps: int, topk: int, draft_tokens: int
) -> Tensor:
    """subtree_accept_len for any shape.

    The smaller round's tree is rebuilt inside this one the way the draft builds it: at each depth, the top
    `topk` children of the frontier, the frontier being the `topk` best of them by score; then the
    `draft_tokens - 1` best nodes. Its nodes carry the same tokens and scores as here (same draft state, same
    ancestors), so its greedy walk is this round's accepted path for as long as the path stays inside it: the
    round emits 1 + that many tokens. Exact whenever the smaller tree lies inside this one (for topk 1: the
    first-child path, each node's most likely draft); otherwise a node it would have drafted is missing here
    and the count is a lower bound (the served tree kept the best nodes of a wider beam, so such nodes rank
    low). test/speculative/test_eagle_verify.py checks both against the smaller round itself.
    """
    n = tree.num_nodes
    dev = tree.parent.device
    idx = torch.arange(n, device=dev)
    parent = tree.parent.clamp(min=0)
    same_parent = tree.parent.unsqueeze(2) == tree.parent.unsqueeze(1)  # [B, m, m']
    sibling_rank = (same_parent & (idx.view(1, 1, n) < idx.view(1, n, 1))).sum(
        2
    )  # siblings are in score order
    frontier = (idx == 0).expand_as(tree.parent)
    kept = frontier.clone()
    for d in range(1, steps + 1):
        drafted = (tree.depth == d) & (sibling_rank < topk) & frontier.gather(1, parent)
        kept = kept | drafted
        frontier = _best_of(drafted, tree.score, topk)
    chosen = _best_of(kept & (idx != 0), tree.score, draft_tokens - 1)
    chosen[:, 0] = True
    inside = chosen.gather(1, accepted_nodes.clamp(min=0)) & (accepted_nodes >= 0)
    return inside.to(torch.int64).cumprod(dim=1).sum(dim=1)
