"""Shared fixtures: tiny random Llama checkpoints with an offline tokenizer, and the shipped SmolLM2 GGUF."""

from __future__ import annotations

import os

# before torch starts OpenMP (see docs/benchmarks_serving.md)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():  # must precede any triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_MERGES = [
    ("t", "h"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("r", "e"), ("o", "n"), ("a", "t"),
    ("e", "n"), ("n", "d"), ("o", "r"), ("e", "s"), ("i", "s"), ("i", "t"), ("a", "l"), ("a", "r"),
    ("s", "t"), ("t", "o"), ("n", "t"), ("n", "g"), ("e", "d"), ("o", "u"), ("l", "e"), ("s", "e"),
    ("h", "a"), ("c", "e"), ("a", "s"), ("o", "f"), ("th", "e"),
]  # fmt: skip


def build_tiny_tokenizer():
    """Character-level BPE over printable ASCII + a few merges: exactly 128 ids, no files, no network."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(_SPECIALS + chars + [a + b for a, b in _MERGES])}
    assert len(vocab) == 128
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(_MERGES), unk_token="<|endoftext|>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=_SPECIALS,
        chat_template=_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _save_tiny_llama(out_dir: str, seed: int, **overrides) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    with torch.no_grad():  # HF inits norms to 1: make every tensor distinct so mix-ups cannot hide
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """Tiny random Llama (tied embeddings, default rope), saved as safetensors + tokenizer."""
    return _save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")), seed=0)


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory) -> str:
    """Like tiny_llama_dir with untied lm_head, 3 layers and Llama-3 rope scaling."""
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    return _save_tiny_llama(
        str(tmp_path_factory.mktemp("tiny_llama3")),
        seed=1,
        num_hidden_layers=3,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=rope,
    )


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    from treepage.models.loader import default_model_path

    return default_model_path()
