"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from treepage.core import Req, TokenLogprob
from treepage.layers.logits_processor import process_logits
from treepage.layers.logprobs import chosen_logprobs

GREEDY_TEMPERATURE_EPS = 1e-6  # temperatures at or below this are greedy requests


def target_probs_from_logits(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor
) -> torch.Tensor:
    """[R, V] logits -> fp32 probabilities: softmax(logits / T), then top-k, then top-p, each renormalised.

    Greedy rows (T <= eps) become one-hot at torch.argmax(logits), the same argmax greedy verification uses,
    so tree sampling on them reduces exactly to greedy verification. top_k <= 0 or >= V disables top-k; top-k
    keeps every token whose probability is >= the k-th largest (ties kept, so the result never depends on sort
    order). top_p >= 1 disables top-p, which keeps the smallest sorted prefix whose mass reaches top_p.
    """
    rows, vocab = logits.shape
    dev = logits.device
    temperatures = temperatures.to(dev, torch.float32)
    greedy = temperatures <= GREEDY_TEMPERATURE_EPS
    temp = torch.where(greedy, 1.0, temperatures)
    probs = torch.softmax(logits.float() / temp.unsqueeze(1), dim=-1)
    top_ks = top_ks.to(dev, torch.int64)
    top_ps = top_ps.to(dev, torch.float32)
    k = torch.where((top_ks <= 0) | (top_ks > vocab), vocab, top_ks)
    need_filter = ((k < vocab) | (top_ps < 1.0)) & ~greedy
    if bool(need_filter.any()):  # one host sync per call; skips a full-vocabulary sort in the common case
        sorted_p, order = probs.sort(dim=-1, descending=True)
        kth = sorted_p.gather(1, (k - 1).unsqueeze(1))
        sorted_p = sorted_p.masked_fill(sorted_p < kth, 0.0)  # ties with the k-th value stay: order-free
        sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
        before = sorted_p.cumsum(-1) - sorted_p
        cut = (before >= top_ps.unsqueeze(1)) & (top_ps < 1.0).unsqueeze(1)
        sorted_p = sorted_p.masked_fill(cut, 0.0)
        sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
        probs = torch.where(
            need_filter.unsqueeze(1), torch.zeros_like(probs).scatter(1, order, sorted_p), probs
        )
    one_hot = torch.zeros_like(probs).scatter(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(1), one_hot, probs)


def sample(logits: torch.Tensor, params: list, generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] -> tokens [B]. Greedy rows take the argmax; others draw with their own generator."""
    out = logits.argmax(-1)
    if all(p.greedy for p in params):
        return out
    dev = logits.device
    temps = torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=dev)
    top_ps = torch.tensor([p.top_p for p in params], device=dev)
    top_ks = torch.tensor([p.top_k for p in params], device=dev)
    probs = target_probs_from_logits(logits, temps, top_ps, top_ks)
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    return out


def sample_reqs(logits: torch.Tensor, reqs: list[Req]) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per request from its row of logits, after the request's logits processors, and its logprob
    entry from the same processed row when the request asks (layers/logprobs.py)."""
    logits = process_logits(logits, reqs)
    toks: list[int] = sample(logits, [r.sampling for r in reqs], [r.generator for r in reqs]).tolist()
    return toks, chosen_logprobs(logits, reqs, toks)


def sample_last(
    logits: torch.Tensor, reqs: list[Req], ends: list[int]
) -> tuple[list[int | None], list[TokenLogprob | None]]:
    """The next token (and logprob entry) of each request whose prefill reached its end; None for a chunk that
    did not (no random numbers are drawn for it, so chunking does not change a seeded request's samples)."""
    done = [i for i, (r, e) in enumerate(zip(reqs, ends)) if e == r.seq_len]
    toks: list[int | None] = [None] * len(reqs)
    lps: list[TokenLogprob | None] = [None] * len(reqs)
    if not done:
        return toks, lps
    picked, picked_lps = sample_reqs(logits[done], [reqs[i] for i in done])
    for i, t, lp in zip(done, picked, picked_lps):
        toks[i], lps[i] = t, lp
    return toks, lps
