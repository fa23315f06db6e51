"""EAGLE-2 dynamic draft tree: the per-step frontier expansion and the final tree (pure tensor algorithms).

Scores are cumulative **log**-probabilities (a sum of log q along the path): products of many small
probabilities underflow in fp32 and would create false ties. Every score is clamped to <= 0 and NaN becomes
-inf, so a child never outranks its parent. All "top-k" choices order candidates by (-score, flat index) with
a stable sort; since a parent has a smaller flat index than its children and a score >= theirs, every prefix of
that order is closed under ancestors, which keeps the final tree valid even with ties.

Flat candidate numbering (per request): step 0 owns flats [0, K); step i >= 1 owns
[K + (i-1)K^2, K + iK^2), child c of frontier rank k at flat K + (i-1)K^2 + kK + c.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class DraftStepState:
    """What the S draft steps of one round accumulate for `build_tree`."""

    scores: Tensor  # [B, K] cumulative log-prob of the current frontier, descending
    score_list: list[Tensor] = field(default_factory=list)  # [B, K] then [B, K*K] per step
    token_list: list[Tensor] = field(default_factory=list)  # same shapes, target vocabulary ids
    parent_list: list[Tensor] = field(
        default_factory=list
    )  # [B, K+1] (P_0) then [B, K] flat ids of frontiers
    # [B, K]: row (0..K-1) of the previous forward that each frontier node descends from; identity at step 0
    last_parent_rows: Tensor | None = None

    @property
    def topk(self) -> int:
        return self.scores.shape[1]


@dataclass
class EagleTree:
    """The N-node verify tree per request (node 0 = root). Index tensors are int64."""

    draft_tokens: Tensor  # [B, N]
    positions: Tensor  # [B, N] L + depth
    depth: Tensor  # [B, N]
    parent: Tensor  # [B, N] node index, -1 for the root
    tree_mask: Tensor  # [B, N, N] bool, row attends col iff col is self or an ancestor
    retrieve_index: Tensor  # [B, N] global row b*N + m
    retrieve_next_token: Tensor  # [B, N] first child or -1
    retrieve_next_sibling: Tensor  # [B, N] next sibling or -1
    # [B, N] cumulative draft log-prob (the root 0): what ranked the nodes; a smaller shape's sub-tree is picked
    # by it (eagle_verify.subtree_accept_len). A chain built without scores gets minus the depth (same order).
    score: Tensor

    @property
    def num_nodes(self) -> int:
        return self.draft_tokens.shape[1]

    def node_paths(self, b: int) -> list[list[int]]:
        """Request b's drafted tokens from the root (exclusive) to each node (inclusive); [] for the root."""
        parents = self.parent[b].tolist()
        tokens = self.draft_tokens[b].tolist()
        paths: list[list[int]] = []
        for m, p in enumerate(parents):  # a parent always precedes its children
            paths.append([] if p < 0 else paths[p] + [tokens[m]])
        return paths


def _log_probs(p: Tensor) -> Tensor:
    logp = torch.log(p.float())
    return torch.where(torch.isnan(logp), float("-inf"), logp).clamp(max=0.0)


def _best_first(scores: Tensor, k: int) -> Tensor:
    """Indices of the k best scores per row, ordered by (-score, index): deterministic under ties."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def draft_step_first(
    topk_p: Tensor, topk_index: Tensor, hidden: Tensor
) -> tuple[DraftStepState, Tensor, Tensor]:
    """Step 0: the draft-extend's top-K become the candidates (and the frontier) under the root."""
    bs, k = topk_p.shape
    scores = _log_probs(topk_p)
    p0 = torch.arange(-1, k, device=topk_p.device).repeat(bs, 1)
    state = DraftStepState(
        scores=scores,
        score_list=[scores],
        token_list=[topk_index],
        parent_list=[p0],
        last_parent_rows=torch.arange(k, device=topk_p.device).repeat(bs, 1),
    )
    return state, topk_index.reshape(-1), hidden.repeat_interleave(k, dim=0)


def _expand(state: DraftStepState, topk_p: Tensor, topk_index: Tensor) -> tuple[Tensor, Tensor]:
    bs, k = state.scores.shape
    scores = (state.scores.unsqueeze(2) + _log_probs(topk_p).view(bs, k, k)).view(bs, k * k)
    tokens = topk_index.reshape(bs, k * k)
    state.score_list.append(scores)
    state.token_list.append(tokens)
    return scores, tokens


def draft_step_next(
    i: int, state: DraftStepState, topk_p: Tensor, topk_index: Tensor, hidden: Tensor
) -> tuple[Tensor, Tensor]:
    """Step i in [1, S-1): expand K*K children of the frontier, keep the best K as the next frontier.

    topk_p / topk_index / hidden are the outputs of forward i-1 on the K frontier rows ([B*K, ...]).
    Returns the next forward's inputs: frontier tokens [B*K] and their parents' output states [B*K, H].
    """
    bs, k = state.scores.shape
    scores, tokens = _expand(state, topk_p, topk_index)
    chosen = _best_first(scores, k)  # [B, K] local index k*K + c
    rows = chosen // k
    state.scores = scores.gather(1, chosen)
    state.parent_list.append(chosen + (k + (i - 1) * k * k))
    state.last_parent_rows = rows
    input_ids = tokens.gather(1, chosen).reshape(-1)
    global_rows = (rows + torch.arange(bs, device=rows.device).unsqueeze(1) * k).reshape(-1)
    return input_ids, hidden.index_select(0, global_rows)


def draft_step_last(i: int, state: DraftStepState, topk_p: Tensor, topk_index: Tensor) -> None:
    """Step S-1: record the K*K children; no frontier is needed since no forward follows."""
    _expand(state, topk_p, topk_index)


def _links(parent: Tensor) -> tuple[Tensor, Tensor]:
    """First child and next sibling of every node: children ordered by node index."""
    bs, n = parent.shape
    idx = torch.arange(n, device=parent.device)
    # [B, node j, node m]: m is a child of j
    is_child = parent.unsqueeze(1) == idx.view(1, n, 1)
    first = torch.where(is_child, idx.view(1, 1, n), n).amin(dim=2)
    # [B, m, m']: m' > m shares m's parent (the root's parent -1 is unique, so the root has no sibling)
    sib = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (idx.view(1, 1, n) > idx.view(1, n, 1))
    nxt = torch.where(sib, idx.view(1, 1, n), n).amin(dim=2)
    return torch.where(first < n, first, -1), torch.where(nxt < n, nxt, -1)


def _finish(
    draft_tokens: Tensor, parent: Tensor, depth: Tensor, score: Tensor, seq_lens: Tensor, max_depth: int
) -> EagleTree:
    bs, n = parent.shape
    dev = parent.device
    eye = torch.eye(n, dtype=torch.bool, device=dev).expand(bs, n, n)
    up = parent.clamp(min=0).unsqueeze(2).expand(bs, n, n)
    mask = eye
    for _ in range(max_depth):  # row m = self | row(parent(m)); converges after max_depth rounds
        mask = eye | mask.gather(1, up)
    next_token, next_sibling = _links(parent)
    retrieve_index = torch.arange(bs, device=dev).unsqueeze(1) * n + torch.arange(n, device=dev)
    return EagleTree(
        draft_tokens=draft_tokens,
        positions=seq_lens.to(dev, torch.int64).unsqueeze(1) + depth,
        depth=depth,
        parent=parent,
        tree_mask=mask.contiguous(),
        retrieve_index=retrieve_index,
        retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling,
        score=score,
    )


def chain_tree(
    root_tokens: Tensor, chain_tokens: Tensor, seq_lens: Tensor, chain_scores: Tensor | None = None
) -> EagleTree:
    """K == 1: the tree is the chain root -> t_1 -> ... -> t_S (N = S + 1); `chain_scores` [B, S] the cumulative
    draft log-probs of t_1..t_S."""
    bs, s = chain_tokens.shape
    n = s + 1
    dev = chain_tokens.device
    idx = torch.arange(n, device=dev)
    tokens = torch.cat([root_tokens.view(bs, 1).to(chain_tokens.dtype), chain_tokens], dim=1)
    depth = idx.repeat(bs, 1)
    if chain_scores is None:
        score = -depth.float()
    else:
        score = torch.cat([torch.zeros(bs, 1, device=dev), chain_scores.float()], dim=1)
    nxt = torch.where(idx + 1 < n, idx + 1, -1).repeat(bs, 1)
    return EagleTree(
        draft_tokens=tokens,
        positions=seq_lens.to(dev, torch.int64).unsqueeze(1) + depth,
        depth=depth,
        parent=(idx - 1).repeat(bs, 1),
        tree_mask=torch.ones(n, n, dtype=torch.bool, device=dev).tril().repeat(bs, 1, 1),
        retrieve_index=torch.arange(bs, device=dev).unsqueeze(1) * n + idx,
        retrieve_next_token=nxt,
        retrieve_next_sibling=torch.full((bs, n), -1, dtype=torch.int64, device=dev),
        score=score,
    )


def build_tree(
    state: DraftStepState,
    root_tokens: Tensor,
    seq_lens: Tensor,
    num_draft_tokens: int,
    topk: int,
    num_steps: int,
) -> EagleTree:
    """Root + the N-1 best candidates (ascending flat order), with parents, depths, mask and links."""
    n, k, s = num_draft_tokens, topk, num_steps
    if len(state.score_list) != s:
        raise ValueError(f"draft state holds {len(state.score_list)} steps, expected num_steps={s}")
    num_cand = k + (s - 1) * k * k
    if not 1 <= n - 1 <= num_cand:
        raise ValueError(f"num_draft_tokens={n} needs 1 <= N-1 <= K + (S-1)K^2 = {num_cand} (K={k}, S={s})")
    tokens = torch.cat(state.token_list, dim=1)
    bs = tokens.shape[0]
    if k == 1:
        if n != s + 1:
            raise ValueError(f"topk=1 requires num_draft_tokens == num_steps + 1, got N={n}, S={s}")
        return chain_tree(root_tokens, tokens, seq_lens, torch.cat(state.score_list, dim=1))
    scores = torch.cat(state.score_list, dim=1)
    sel = _best_first(scores, n - 1).sort(dim=1).values  # [B, N-1] flat ids, ascending
    parent_flat = torch.cat(state.parent_list, dim=1).gather(1, sel // k)  # -1 => child of the root
    # the selection is ancestor-closed and sorted, so the parent's node is its rank in `sel` plus one
    parent_node = torch.searchsorted(sel, parent_flat.clamp(min=0).contiguous()) + 1
    parent_node = torch.where(parent_flat < 0, 0, parent_node)
    root = torch.full((bs, 1), -1, dtype=torch.int64, device=tokens.device)
    parent = torch.cat([root, parent_node], dim=1)
    depth_sel = torch.where(sel < k, 1, 2 + (sel - k) // (k * k))
    depth = torch.cat([torch.zeros_like(root), depth_sel], dim=1)
    draft_tokens = torch.cat([root_tokens.view(bs, 1).to(tokens.dtype), tokens.gather(1, sel)], dim=1)
    score = torch.cat([torch.zeros(bs, 1, device=tokens.device), scores.gather(1, sel)], dim=1)
    return _finish(draft_tokens, parent, depth, score, seq_lens, s)
