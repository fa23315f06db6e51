"""Incremental detokenisation: each step decodes a short window of ids, never the whole output again."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """New text for new ids, from the difference of two decodes over a window.

    The window starts a few ids back (at `prefix`), so a byte-level tokenizer sees the context it needs to place
    spaces and join multi-byte characters; text ending in U+FFFD (an incomplete UTF-8 sequence) is held until
    the ids that complete it arrive.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # ids before this are already in the emitted text

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def add(self, ids: list[int], final: bool = False) -> str:
        """Text the new ids complete; `final` releases a held incomplete character as is."""
        self.ids.extend(ids)
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") and not final:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]


def held_stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that could begin a stop string (it is held back from streaming)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold
