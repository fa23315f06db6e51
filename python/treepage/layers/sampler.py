"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch


def filtered_probs(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor
):
    """Softmax of logits/T restricted to top-k and top-p, renormalised. Rows with T == 0 are one-hot argmax."""
    logits = logits.float()
    greedy = temperatures <= 0
    t = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    probs = torch.softmax(logits / t[:, None], dim=-1)
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_ks > 0, top_ks, torch.full_like(top_ks, probs.shape[-1]))
    keep = ranks < k[:, None]
    cum = sorted_p.cumsum(-1)
    keep &= (cum - sorted_p) < top_ps[:, None]  # keep the smallest prefix whose mass reaches top_p
    keep[:, 0] = True
    sorted_p = sorted_p * keep
    probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    probs = probs / probs.sum(-1, keepdim=True)
    onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, probs)


def sample(logits: torch.Tensor, params: list, generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] -> tokens [B]. Greedy rows take the argmax; others draw with their own generator."""
    out = logits.argmax(-1)
    if all(p.greedy for p in params):
        return out
    dev = logits.device
    temps = torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=dev)
    top_ps = torch.tensor([p.top_p for p in params], device=dev)
    top_ks = torch.tensor([p.top_k for p in params], device=dev)
    probs = filtered_probs(logits, temps, top_ps, top_ks)
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    return out
