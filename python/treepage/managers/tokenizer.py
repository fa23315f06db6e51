"""Tokenizer loading (HF dir or GGUF, always offline) and chat-template encoding."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from treepage.models.config import ModelConfig
from treepage.models.loader import resolve_checkpoint

if TYPE_CHECKING:  # transformers is imported lazily: it is slow to import
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(path: str, tokenizer_path: str | None = None) -> PreTrainedTokenizerBase:
    """A transformers fast tokenizer carrying the checkpoint's chat template; never touches the network."""
    from transformers import AutoTokenizer

    where = tokenizer_path or path
    if os.path.isdir(where) and any(
        os.path.isfile(os.path.join(where, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return AutoTokenizer.from_pretrained(where, local_files_only=True)  # tokenizer files need no weights
    kind, p = resolve_checkpoint(where)
    if kind == "gguf":
        # transformers rebuilds the BPE vocab, merges, special tokens and chat template from tokenizer.ggml.*
        return AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(p)), gguf_file=os.path.basename(p), local_files_only=True
        )
    return AutoTokenizer.from_pretrained(p, local_files_only=True)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], add_generation_prompt: bool = True
) -> list[int]:
    """Render to text, then encode without extra special tokens (the template already places them)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat template; send a plain prompt instead"
        )
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def eos_token_ids(tokenizer: PreTrainedTokenizerBase | None, config: ModelConfig) -> list[int]:
    """Ordered union: config ids first, then the tokenizer's eos (instruct models end turns with it)."""
    ids = list(config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return list(dict.fromkeys(ids))
