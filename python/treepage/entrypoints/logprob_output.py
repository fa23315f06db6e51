"""Logprob entries (`core.TokenLogprob`) in the response shapes clients parse: SGLang's meta_info lists and
OpenAI's completion and chat `logprobs` objects (docs/api_fields.md, "Logprobs")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from treepage.core import LogprobParams, TokenLogprob


def token_text(tokenizer: Any, token: int) -> str:
    return str(tokenizer.decode([token]))


def _triple(tokenizer: Any, with_text: bool, logprob: float | None, token: int) -> list[Any]:
    return [logprob, token, token_text(tokenizer, token) if with_text else None]


def add_native_logprobs(out: dict[str, Any], lp: LogprobParams, tokenizer: Any, with_text: bool) -> None:
    """SGLang's meta_info keys from a snapshot's entries: `*_token_logprobs` as [logprob, id, text-or-null] per
    position; `*_top_logprobs` (when top_logprobs_num > 0) and `*_token_ids_logprobs` (when token_ids_logprob
    is given) as a list of such triples per position, null where there is none (the first prompt token)."""
    meta = dict(out["meta_info"])
    for side in ("input", "output"):
        entries: list[TokenLogprob] = out[f"{side}_logprobs"]
        meta[f"{side}_token_logprobs"] = [_triple(tokenizer, with_text, e.logprob, e.token) for e in entries]
        if lp.top_n > 0:
            meta[f"{side}_top_logprobs"] = [
                [_triple(tokenizer, with_text, v, t) for v, t in e.top] if e.logprob is not None else None
                for e in entries
            ]
        if lp.token_ids:
            meta[f"{side}_token_ids_logprobs"] = [
                [_triple(tokenizer, with_text, v, t) for v, t in e.ids] if e.logprob is not None else None
                for e in entries
            ]
    out["meta_info"] = meta


def completion_logprobs(
    entries: Sequence[TokenLogprob], tokenizer: Any, top_n: int, text_offset: int = 0
) -> dict[str, Any]:
    """OpenAI's legacy completions object: parallel lists of token strings, logprobs (null for the first prompt
    token of an echo), top-n dicts (null there too) and each token's character offset in the choice's text."""
    tokens, offsets = [], []
    for e in entries:
        s = token_text(tokenizer, e.token)
        tokens.append(s)
        offsets.append(text_offset)
        text_offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            {token_text(tokenizer, t): v for v, t in e.top[:top_n]} if e.logprob is not None else None
            for e in entries
        ],
        "text_offset": offsets,
    }


def _chat_token(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    s = token_text(tokenizer, token)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob], tokenizer: Any, top_n: int) -> dict[str, Any]:
    """OpenAI's chat object: `content`, one item per output token with its `top_logprobs` (top_n of them)."""
    content = []
    for e in entries:
        assert e.logprob is not None
        item = _chat_token(tokenizer, e.token, e.logprob)
        item["top_logprobs"] = [_chat_token(tokenizer, t, v) for v, t in e.top[:top_n]]
        content.append(item)
    return {"content": content, "refusal": None}
