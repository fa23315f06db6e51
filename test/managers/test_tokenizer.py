from __future__ import annotations

import dataclasses

import pytest

from treepage.managers.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer
from treepage.models.loader import load_config

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf_path):
    return load_tokenizer(smollm2_gguf_path)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_smollm2_gguf_round_trip(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(PROMPT, add_special_tokens=False)
    assert ids == [504, 3575, 282, 4649, 314]
    assert smollm2_tokenizer.decode(ids) == PROMPT


def test_smollm2_chat_template(smollm2_tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    ids = apply_chat_template(smollm2_tokenizer, messages)
    text = smollm2_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> = 1, <|im_end|> = 2, as single tokens
    no_prompt = apply_chat_template(smollm2_tokenizer, messages, add_generation_prompt=False)
    assert smollm2_tokenizer.decode(no_prompt).endswith("Hi<|im_end|>\n")


def test_smollm2_eos(smollm2_tokenizer, smollm2_gguf_path):
    cfg = load_config(smollm2_gguf_path)
    assert smollm2_tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert eos_token_ids(smollm2_tokenizer, cfg) == [2]


def test_tiny_tokenizer_offline(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    ids = tok.encode("hello, the world!", add_special_tokens=False)
    assert max(ids) < load_config(tiny_llama_dir).vocab_size
    assert tok.decode(ids) == "hello, the world!"
    text = tok.decode(apply_chat_template(tok, [{"role": "user", "content": "hi"}]))
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_path_override(tiny_llama_dir, tmp_path):
    tok = load_tokenizer(str(tmp_path / "weights_elsewhere"), tokenizer_path=tiny_llama_dir)
    assert tok.eos_token == "<|im_end|>"


def test_eos_union(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    cfg = load_config(tiny_llama_dir)
    assert eos_token_ids(tok, cfg) == [2]
    assert eos_token_ids(tok, dataclasses.replace(cfg, eos_token_ids=[5, 2])) == [5, 2]
    assert eos_token_ids(tok, dataclasses.replace(cfg, eos_token_ids=[])) == [2]


def test_missing_chat_template_error(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}])
