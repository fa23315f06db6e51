"""The log-probabilities reported to clients, computed only for requests that ask (`Req.logprob`).

Which distribution (SGLang's default, docs/api_fields.md): a greedy request (temperature 0 or top_k 1) reports
log_softmax(logits); a sampled one log_softmax(logits / temperature). top-k and top-p are not applied: they decide
which tokens may be drawn, not how likely the model finds them. A row that chooses a token uses the logits after
`logits_processor.process_logits` (penalties, logit_bias and grammar masks show, as in the token choice); prompt
rows use the model's logits. In a verify round the row of the accepted path's j-th node gives the distribution of
the j-th emitted token, the distribution a plain decode step computes for it, so values do not depend on whether
the token came from a verified tree. -inf (a masked token) is reported as the float32 minimum, a finite JSON number.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from treepage.core import Req, StepOutput, TokenLogprob


def wanted(reqs: Sequence[Req]) -> bool:
    return any(r.logprob is not None for r in reqs)


def token_logprobs(logits: Tensor, reqs: Sequence[Req], tokens: Sequence[int]) -> list[TokenLogprob]:
    """Row i of `logits` [R, V] is the distribution request reqs[i] chose (or would choose) tokens[i] from."""
    if not reqs:
        return []
    dev = logits.device
    temps = torch.tensor([1.0 if r.sampling.greedy else r.sampling.temperature for r in reqs], device=dev)
    lp = torch.log_softmax(logits.float() / temps.unsqueeze(1), dim=-1)
    lp = lp.clamp(min=torch.finfo(torch.float32).min)
    idx = torch.tensor(list(tokens), dtype=torch.int64, device=dev)
    chosen = lp.gather(1, idx.unsqueeze(1)).squeeze(1).tolist()
    tops = [r.logprob.top_n if r.logprob is not None else 0 for r in reqs]
    k = max(tops)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k > 0:
        vals, ids = lp.topk(k, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    out = []
    for i, (r, t) in enumerate(zip(reqs, tokens)):
        e = TokenLogprob(t, chosen[i])
        if tops[i]:
            e.top = list(zip(top_vals[i][: tops[i]], top_ids[i][: tops[i]]))
        if r.logprob is not None and r.logprob.token_ids:
            want = list(r.logprob.token_ids)
            e.ids = list(zip(lp[i, torch.tensor(want, device=dev)].tolist(), want))
        out.append(e)
    return out


def chosen_logprobs(logits: Tensor, reqs: Sequence[Req], tokens: Sequence[int]) -> list[TokenLogprob | None]:
    """One entry per request that asks (None for the others): `logits` [B, V] is the row its token was chosen
    from. Costs nothing when no request asks."""
    ask = [i for i, r in enumerate(reqs) if r.logprob is not None]
    out: list[TokenLogprob | None] = [None] * len(reqs)
    if ask:
        rows = logits[torch.tensor(ask, device=logits.device)] if len(ask) < len(reqs) else logits
        for i, e in zip(ask, token_logprobs(rows, [reqs[i] for i in ask], [tokens[i] for i in ask])):
            out[i] = e
    return out


def needs_prompt_logprobs(r: Req) -> bool:
    """Prompt entries are computed by the first prefill only: once a token is out they were all delivered."""
    return r.logprob is not None and r.logprob.start >= 0 and not r.output_ids


def first_prompt_logit(r: Req) -> int:
    """The first position whose logits the next prompt entry not delivered yet needs (the entry of token p comes
    from position p - 1). Admission keeps the prefix-cache hit at or below it: cached positions have no logits."""
    assert r.logprob is not None
    return max(r.logprob.start + r.input_logprobs_len - 1, 0)


def prefill_logit_starts(reqs: Sequence[Req], starts: Sequence[int], ends: Sequence[int]) -> list[int] | None:
    """Per request, the first position of its chunk [start, end) that needs logits: the last one unless prompt
    entries are wanted there. None when no request asks (the runner's default: last rows only)."""
    if not any(needs_prompt_logprobs(r) for r in reqs):
        return None
    out = []
    for r, a, e in zip(reqs, starts, ends):
        first = e - 1
        if needs_prompt_logprobs(r):
            first = min(max(a, first_prompt_logit(r)), e - 1)
        out.append(first)
    return out


def split_prefill_logits(
    logits: Tensor,
    reqs: Sequence[Req],
    ends: Sequence[int],
    logit_starts: Sequence[int] | None,
) -> tuple[Tensor, list[tuple[int, list[TokenLogprob]] | None]]:
    """(each request's last row, its prompt entries as (first position, entries) or None).

    Row q of a chunk gives the entry of prompt token q + 1 (positions logprob.start .. prompt end); the first
    prompt token has none to come from and gets a None logprob.
    """
    if logit_starts is None:
        return logits, [None] * len(reqs)
    counts = [e - f for f, e in zip(logit_starts, ends)]
    last = torch.tensor(counts, device=logits.device).cumsum(0) - 1
    rows: list[int] = []
    row_reqs: list[Req] = []
    row_tokens: list[int] = []
    spans: list[tuple[int, bool, int, int] | None] = []  # (first position, token 0 first, first row, rows)
    base = 0
    for r, f, e, c in zip(reqs, logit_starts, ends, counts):
        if needs_prompt_logprobs(r):
            assert r.logprob is not None
            s, n, head = r.logprob.start, len(r.input_ids), len(rows)
            for q in range(f, e):
                if s <= q + 1 < n:
                    rows.append(base + q - f)
                    row_reqs.append(r)
                    row_tokens.append(r.input_ids[q + 1])
            first_token = s == 0 and f == 0  # the chunk starts the prompt and entry 0 is not delivered yet
            spans.append((0 if first_token else max(f + 1, s), first_token, head, len(rows) - head))
        else:
            spans.append(None)
        base += c
    entries = token_logprobs(logits[torch.tensor(rows, device=logits.device)], row_reqs, row_tokens) if rows else []
    out: list[tuple[int, list[TokenLogprob]] | None] = []
    for r, span in zip(reqs, spans):
        if span is None:
            out.append(None)
            continue
        pos0, first_token, head, k = span
        out.append((pos0, [TokenLogprob(r.input_ids[0], None)] * first_token + entries[head : head + k]))
    return logits[last], out


def prefill_output(
    token: int | None, end: int, lp: TokenLogprob | None, prompt: tuple[int, list[TokenLogprob]] | None
) -> StepOutput:
    """A prefill step's output: its token, if the prefill reached the end, and the logprob entries computed."""
    out = StepOutput([token] if token is not None else [], end, logprobs=[lp] if lp else None)
    if prompt is not None:
        out.input_logprobs_start, out.input_logprobs = prompt
    return out
