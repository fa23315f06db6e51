"""Oracle 1 (DESIGN §8): our Llama forward and greedy generation equal transformers on the same checkpoint.

Logits go through the engine's own ModelRunner and attention backend (prefill, prefix extend and decode forwards
on a paged row), so the parity covers the KV layout and the page-table readers, not only the module maths.
"""

from __future__ import annotations

import os

import pytest
import torch

from model_utils import runner_logits
from treepage.entrypoints.engine import Engine
from treepage.server_args import ServerArgs

NEW_TOKENS = 64
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
TEXT = "The theory of relativity is one of the two pillars of modern physics, and"


def hf_from_dir(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_from_gguf(path: str) -> torch.nn.Module:
    """transformers' own GGUF reader (config, dequantization, Q/K un-permutation): an independent reference.

    This is what from_pretrained(dir, gguf_file=...) does inside, minus its hard `accelerate` requirement.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys, result
    assert result.missing_keys == (["lm_head.weight"] if config.tie_word_embeddings else []), result
    model.tie_weights()
    assert (
        torch.equal(model.lm_head.weight, model.model.embed_tokens.weight) or not config.tie_word_embeddings
    )
    return model.eval()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=None,  # ours runs with ignore_eos: neither side may stop or mask EOS
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def check_parity(engine: Engine, hf: torch.nn.Module, ids: list[int], atol: float = 1e-3) -> None:
    layer = engine.scheduler.worker.runner.model.model.layers[0]
    assert layer.self_attn.qkv is not None and layer.mlp.gate_up is not None  # the fused projections serve
    # Greedy first, while the scheduler runs; then stop it and drive the runner by hand.
    out = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
    ref = hf_greedy(hf, ids, NEW_TOKENS)
    assert len(ref) == NEW_TOKENS
    assert out["output_ids"] == ref
    engine.wait_idle()
    engine.stop_scheduler()

    ours = runner_logits(engine, ids)
    theirs = hf_logits(hf, ids)
    assert ours.shape == theirs.shape
    assert (ours[-1] - theirs[-1]).abs().max().item() < atol  # the last position: what sampling sees
    assert (ours - theirs).abs().max().item() < atol  # and every position of every kind of forward
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize(
    "fixture,page_size,backend",
    [
        ("tiny_llama_dir", 1, "torch_native"),
        ("tiny_llama_dir", 16, "sdpa"),
        ("tiny_llama3_dir", 4, "torch_native"),  # untied lm_head, 3 layers, Llama-3 rope scaling
        ("tiny_llama3_dir", 64, "sdpa"),
    ],
)
def test_tiny_llama_parity(fixture: str, page_size: int, backend: str, request) -> None:
    path = request.getfixturevalue(fixture)
    hf = hf_from_dir(path)
    engine = Engine(
        ServerArgs(
            model_path=path,
            dtype="float32",
            page_size=page_size,
            attention_backend=backend,
            max_total_tokens=1024,
        )
    )
    try:
        ids = engine.tokenizer.encode(TEXT)
        assert (
            len(ids) > 32
        )  # prefill and decodes span several pages for P <= 16; P = 64 is crossed by decode
        check_parity(engine, hf, ids)
    finally:
        engine.shutdown()


def test_tiny_llama_parity_long_prefill_paths(tiny_llama3_dir: str, monkeypatch) -> None:
    """The paths a long prefill takes (separate projections instead of the fused matmul, SDPA per request on the
    fresh prompt's own K/V instead of the kernel), forced at tiny sizes, equal transformers too."""
    from treepage.layers import linear
    from treepage.layers.attention import torch_native_backend

    monkeypatch.setattr(linear, "FUSED_MAX_ROWS", 0)
    monkeypatch.setattr(torch_native_backend, "KERNEL_MAX_EXTEND", 0)
    hf = hf_from_dir(tiny_llama3_dir)
    engine = Engine(ServerArgs(model_path=tiny_llama3_dir, dtype="float32", page_size=4, max_total_tokens=1024))
    try:
        check_parity(engine, hf, engine.tokenizer.encode(TEXT))
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_smollm2_gguf_parity(smollm2_gguf_path: str) -> None:
    hf = hf_from_gguf(smollm2_gguf_path)
    engine = Engine(
        ServerArgs(model_path=smollm2_gguf_path, dtype="float32", page_size=16, max_total_tokens=512)
    )
    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        check_parity(engine, hf, ids)
    finally:
        engine.shutdown()
