"""EAGLE / EAGLE-3 heads: released layouts round-trip through files and match a dense re-implementation."""

from __future__ import annotations

import pytest
import torch

from spec_utils import random_eagle_head
from treepage.layers.attention.torch_native_backend import TorchNativeAttnBackend
from treepage.layers.forward_batch import ForwardBatch, ForwardMode
from treepage.mem_cache.memory_pool import KVPool
from treepage.models.config import ModelConfig
from treepage.models.eagle_checkpoint import (
    draft_vocab_maps,
    eagle_head_from_target,
    hot_ids_from_counts,
    hot_ids_from_d2t,
    save_eagle_head,
)
from treepage.models.llama import LlamaForCausalLM
from treepage.models.llama_eagle import LlamaForCausalLMEagle
from treepage.models.llama_eagle3 import LlamaForCausalLMEagle3
from treepage.models.loader import load_config, load_state_dict, load_weights_into

MAX_POS = 64
HEADS = {"LlamaForCausalLMEagle": LlamaForCausalLMEagle, "LlamaForCausalLMEagle3": LlamaForCausalLMEagle3}


# ---------------------------------------------------------------- dense reference, written from the facts sheet
def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    d = x.shape[-1]
    ang = pos[:, None].double() / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def dense_attention(u, pos, S, p, cfg):
    """Causal GQA attention over all given rows, no KV cache."""
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // nh
    T = u.shape[0]
    q = rope((u @ S[p + "self_attn.q_proj.weight"].T).view(T, nh, d), pos, cfg["rope_theta"])
    k = rope((u @ S[p + "self_attn.k_proj.weight"].T).view(T, nkv, d), pos, cfg["rope_theta"])
    v = (u @ S[p + "self_attn.v_proj.weight"].T).view(T, nkv, d)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, nh * d)
    return o @ S[p + "self_attn.o_proj.weight"].T


def mlp_block(h, S, p, eps):
    x = rms(h, S[p + "post_attention_layernorm.weight"], eps)
    gate, up = x @ S[p + "mlp.gate_proj.weight"].T, x @ S[p + "mlp.up_proj.weight"].T
    return h + (torch.nn.functional.silu(gate) * up) @ S[p + "mlp.down_proj.weight"].T


def ref_eagle1(S, cfg, emb, feats, pos):
    z = torch.cat([emb, feats], -1) @ S["fc.weight"].T + S.get("fc.bias", 0.0)
    h1 = z + dense_attention(z, pos, S, "layers.0.", cfg)
    return mlp_block(h1, S, "layers.0.", cfg["rms_norm_eps"])


def ref_eagle3(S, cfg, emb, g, pos):
    """g: the H-wide state per row (fc already applied to target-feature rows)."""
    eps, p = cfg["rms_norm_eps"], "midlayer."
    u = torch.cat(
        [rms(emb, S[p + "input_layernorm.weight"], eps), rms(g, S[p + "hidden_norm.weight"], eps)], -1
    )
    h1 = g + dense_attention(u, pos, S, p, cfg)
    return mlp_block(h1, S, p, eps)


# ---------------------------------------------------------------- helpers
def load_target(path: str) -> LlamaForCausalLM:
    model = LlamaForCausalLM(load_config(path), MAX_POS)
    load_weights_into(model, load_state_dict(path, progress=False))
    return model.eval()


def load_head(path: str, target: torch.nn.Module):
    cfg = load_config(path)
    head = HEADS[cfg.architecture](cfg, MAX_POS)
    head.load_weights(load_state_dict(path, progress=False))
    head.bind_target(target)
    return head.eval()


class DraftKV:
    """One request, page size 1: position i lives in slot i + 1 (slot 0 stays unused)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.pool = KVPool(MAX_POS + 1, 1, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
        self.req_to_token = torch.arange(1, MAX_POS + 1, dtype=torch.int64)[None]
        self.backend = TorchNativeAttnBackend()

    def run(self, head, ids: torch.Tensor, hidden: torch.Tensor, start: int) -> torch.Tensor:
        T = ids.shape[0]
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=ids,
            positions=torch.arange(start, start + T),
            out_cache_loc=torch.arange(start + 1, start + T + 1),
            req_rows=torch.tensor([0]),
            req_to_token=self.req_to_token,
            kv_pool=self.pool,
            attn_backend=self.backend,
            page_size=1,
            prefix_lens=[start],
            extend_lens=[T],
            input_hidden=hidden,
        )
        self.backend.init_forward_metadata(fb)
        with torch.no_grad():
            return head(fb).hidden


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------- EAGLE-1
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("bias", [None, False])
def test_eagle1_roundtrip_matches_dense_reference(tiny_llama3_dir, tmp_path, fmt, bias):
    target = load_target(tiny_llama3_dir)  # untied lm_head: logits must come from it, not the embedding
    cfg_d, S = random_eagle_head(target.config, "EAGLE", seed=3, bias=bias)
    assert ("bias" in cfg_d) == (bias is not None) and ("fc.bias" in S) == (bias is None)
    assert "embed_tokens.weight" not in S and "lm_head.weight" not in S and "norm.weight" not in S
    assert S["fc.weight"].shape == (64, 128) and "layers.0.input_layernorm.weight" not in S
    cfg_d.update(rope_theta=20000.0, rope_scaling=None)  # the head's own RoPE, not the target's llama3 one
    save_eagle_head(tmp_path, cfg_d, S, fmt=fmt)
    assert (tmp_path / ("model.safetensors" if fmt == "safetensors" else "pytorch_model.bin")).is_file()

    cfg = load_config(str(tmp_path))
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (
        "LlamaForCausalLMEagle", 1, 2, 16,
    )  # fmt: skip
    head = load_head(str(tmp_path), target)
    assert head.feature_kind == "last"

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (9,), generator=g)
    feats = torch.randn(9, 64, generator=g)
    kv = DraftKV(cfg)
    out1 = kv.run(head, ids[:6], feats[:6], 0)
    # Draft steps feed the head's own output back as the feature, on top of the cached rows.
    f2 = out1[3:6]
    out2 = kv.run(head, ids[6:], f2, 6)

    E = target.model.embed_tokens.weight.detach()
    ref = ref_eagle1(S, cfg_d, E[ids], torch.cat([feats[:6], f2]), torch.arange(9))
    close(out1, ref[:6])
    close(out2, ref[6:])
    logits = head.compute_logits(out2)
    assert logits.dtype == torch.float32 and logits.shape == (3, 128)
    close(logits, ref[6:] @ target.lm_head.weight.detach().T)
    draft_ids = logits.topk(4, dim=-1).indices
    assert torch.equal(head.map_to_target_ids(draft_ids), draft_ids)


def test_eagle1_ignores_shipped_embedding_lm_head_and_rope_tables(tiny_llama_dir):
    target = load_target(tiny_llama_dir)
    cfg_d, S = random_eagle_head(target.config, "EAGLE", seed=1)
    extra = {
        "embed_tokens.weight": torch.zeros(128, 64),
        "lm_head.weight": torch.zeros(128, 64),
        "layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8),
    }
    head = LlamaForCausalLMEagle(ModelConfig.from_hf_dict(cfg_d), MAX_POS)
    head.load_weights({"model." + n: t for n, t in S.items()} | extra)
    head.bind_target(target)
    assert head.embed_tokens is target.model.embed_tokens and head.lm_head is target.lm_head
    assert torch.equal(head.layers[0].self_attn.q_proj.weight, S["layers.0.self_attn.q_proj.weight"])


def test_eagle1_bad_checkpoints_raise_clear_errors(tiny_llama_dir):
    target_cfg = load_config(tiny_llama_dir)
    cfg_d, S = random_eagle_head(target_cfg, "EAGLE", seed=1)
    cfg = ModelConfig.from_hf_dict(cfg_d)
    with pytest.raises(ValueError, match=r"missing tensors: fc\.weight"):
        LlamaForCausalLMEagle(cfg, MAX_POS).load_weights({n: t for n, t in S.items() if n != "fc.weight"})
    with pytest.raises(ValueError, match=r"missing tensors: fc\.bias"):  # no "bias" key means a bias
        LlamaForCausalLMEagle(cfg, MAX_POS).load_weights({n: t for n, t in S.items() if n != "fc.bias"})
    bad = S | {"fc.weight": torch.zeros(64, 64)}
    with pytest.raises(
        ValueError, match=r"shape mismatch for fc\.weight: checkpoint \(64, 64\) vs head \(64, 128\)"
    ):
        LlamaForCausalLMEagle(cfg, MAX_POS).load_weights(bad)
    with pytest.raises(ValueError, match=r"unexpected tensors: layers\.1\.mlp\.up_proj\.weight"):
        LlamaForCausalLMEagle(cfg, MAX_POS).load_weights(S | {"layers.1.mlp.up_proj.weight": torch.zeros(1)})
    no_bias = ModelConfig.from_hf_dict(cfg_d | {"bias": False})
    with pytest.raises(ValueError, match="fc.bias"):
        LlamaForCausalLMEagle(no_bias, MAX_POS).load_weights(S)
    head = LlamaForCausalLMEagle(cfg, MAX_POS)
    with pytest.raises(RuntimeError, match="bind_target"):
        DraftKV(cfg).run(head, torch.tensor([1]), torch.zeros(1, 64), 0)


# ---------------------------------------------------------------- EAGLE-3
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("vd", [128, 48])
def test_eagle3_roundtrip_matches_dense_reference(tiny_llama_dir, tmp_path, fmt, vd):
    target = load_target(tiny_llama_dir)
    cfg_d, S = random_eagle_head(target.config, "EAGLE3", draft_vocab_size=vd, seed=5)
    assert S["fc.weight"].shape == (64, 192) and S["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert S["midlayer.self_attn.k_proj.weight"].shape == (32, 128) and S["lm_head.weight"].shape == (vd, 64)
    assert S["d2t"].dtype == torch.int64 and S["d2t"].shape == (vd,)
    assert S["t2d"].dtype == torch.bool and S["t2d"].shape == (128,) and int(S["t2d"].sum()) == vd
    assert "fc.bias" not in S and "embed_tokens.weight" not in S
    cfg_d["rope_theta"] = 30000.0
    save_eagle_head(tmp_path, cfg_d, S, fmt=fmt)

    cfg = load_config(str(tmp_path))
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (
        "LlamaForCausalLMEagle3", 1, 2, 16,
    )  # fmt: skip
    assert cfg.hf_config["draft_vocab_size"] == vd
    head = load_head(str(tmp_path), target)
    assert head.feature_kind == "aux" and head.embed_tokens is target.model.embed_tokens

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (8,), generator=g)
    feats = torch.randn(5, 192, generator=g)  # concat of three captured target layers
    kv = DraftKV(cfg)
    out1 = kv.run(head, ids[:5], feats, 0)
    own = out1[[4, 4, 2]]  # recurrent states: H wide, fc must be skipped
    out2 = kv.run(head, ids[5:], own, 5)

    states = torch.cat([feats @ S["fc.weight"].T, own])
    E = target.model.embed_tokens.weight.detach()
    ref = ref_eagle3(S, cfg_d, E[ids], states, torch.arange(8))
    close(out1, ref[:5])
    close(out2, ref[5:])
    logits = head.compute_logits(out2)
    assert logits.dtype == torch.float32 and logits.shape == (3, vd)
    close(logits, rms(ref[5:], S["norm.weight"], cfg_d["rms_norm_eps"]) @ S["lm_head.weight"].T)
    hot = torch.nonzero(S["t2d"]).flatten()
    draft_ids = logits.topk(4, dim=-1).indices
    assert torch.equal(head.map_to_target_ids(draft_ids), hot[draft_ids])


def test_eagle3_width_rule(tiny_llama_dir):
    target = load_target(tiny_llama_dir)
    cfg_d, S = random_eagle_head(target.config, "EAGLE3", draft_vocab_size=32, seed=2)
    cfg = ModelConfig.from_hf_dict(cfg_d)
    head = LlamaForCausalLMEagle3(cfg, MAX_POS)
    head.load_weights(S)
    head.bind_target(target)
    ids = torch.tensor([3, 7, 11])
    g = torch.Generator().manual_seed(2)
    wide, narrow = torch.randn(3, 192, generator=g), torch.randn(3, 64, generator=g)
    a_wide, a_narrow = DraftKV(cfg).run(head, ids, wide, 0), DraftKV(cfg).run(head, ids, narrow, 0)
    E = target.model.embed_tokens.weight.detach()
    close(a_wide, ref_eagle3(S, cfg_d, E[ids], wide @ S["fc.weight"].T, torch.arange(3)))
    close(a_narrow, ref_eagle3(S, cfg_d, E[ids], narrow, torch.arange(3)))
    with torch.no_grad():
        head.fc.weight.mul_(2.0)
    assert torch.equal(DraftKV(cfg).run(head, ids, narrow, 0), a_narrow)  # fc untouched for H-wide states
    assert not torch.allclose(DraftKV(cfg).run(head, ids, wide, 0), a_wide)
    with pytest.raises(ValueError, match="width 192 .* or 64"):
        DraftKV(cfg).run(head, ids, torch.zeros(3, 128), 0)


def test_eagle3_d2t_mapping_and_vocab_helpers(tiny_llama_dir):
    cfg_d, S = random_eagle_head(load_config(tiny_llama_dir), "EAGLE3", draft_vocab_size=20, seed=4)
    head = LlamaForCausalLMEagle3(ModelConfig.from_hf_dict(cfg_d), MAX_POS)
    state = {n: t for n, t in S.items() if n != "t2d"}  # t2d is optional: rebuilt from d2t
    head.load_weights(state)
    mapped = head.map_to_target_ids(torch.arange(20))
    assert torch.all(mapped[1:] > mapped[:-1]) and int(mapped.max()) < 128
    assert torch.equal(mapped, torch.nonzero(S["t2d"]).flatten())
    assert torch.equal(head.t2d, S["t2d"])

    hot = torch.tensor([90, 5, 17, 3])
    d2t, t2d = draft_vocab_maps(hot, 100)
    assert d2t.tolist() == [3 - 0, 5 - 1, 17 - 2, 90 - 3] and t2d.sum() == 4 and t2d[[3, 5, 17, 90]].all()
    assert hot_ids_from_d2t(d2t).tolist() == [3, 5, 17, 90]
    with pytest.raises(ValueError, match="distinct"):
        draft_vocab_maps(torch.tensor([1, 1]), 10)
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    assert hot_ids_from_counts(counts, 3).tolist() == [2, 3, 5]
    # Widening a draft vocabulary: its own ids stay, the most frequent others fill the rest.
    assert hot_ids_from_counts(counts, 3, keep=torch.tensor([1])).tolist() == [1, 2, 3]
    assert hot_ids_from_counts(counts, 2, keep=torch.tensor([4, 1])).tolist() == [1, 4]
    with pytest.raises(ValueError, match="cannot keep 2 ids"):
        hot_ids_from_counts(counts, 1, keep=torch.tensor([4, 1]))


def test_eagle3_accepts_layers0_alias_and_ignores_frozen_embedding(tiny_llama_dir):
    cfg_d, S = random_eagle_head(load_config(tiny_llama_dir), "EAGLE3", draft_vocab_size=48, seed=6)
    renamed = {n.replace("midlayer.", "layers.0."): t for n, t in S.items()}
    renamed["embed_tokens.weight"] = torch.zeros(128, 64)
    head = LlamaForCausalLMEagle3(ModelConfig.from_hf_dict(cfg_d), MAX_POS)
    head.load_weights(renamed)
    assert torch.equal(head.midlayer.hidden_norm.weight, S["midlayer.hidden_norm.weight"])
    assert torch.equal(head.lm_head.weight, S["lm_head.weight"]) and torch.equal(head.d2t, S["d2t"])


def test_eagle3_bad_checkpoints_raise_clear_errors(tiny_llama_dir):
    cfg_d, S = random_eagle_head(load_config(tiny_llama_dir), "EAGLE3", draft_vocab_size=48, seed=7)
    cfg = ModelConfig.from_hf_dict(cfg_d)

    def load(state):
        LlamaForCausalLMEagle3(cfg, MAX_POS).load_weights(state)

    with pytest.raises(ValueError, match=r"EAGLE-3 draft head: missing tensors: fc\.weight"):
        load({n: t for n, t in S.items() if n != "fc.weight"})
    with pytest.raises(ValueError, match=r"missing tensors: d2t"):  # draft vocab smaller than the target's
        load({n: t for n, t in S.items() if n != "d2t"})
    q = "midlayer.self_attn.q_proj.weight"
    with pytest.raises(
        ValueError, match=rf"shape mismatch for {q}: checkpoint \(64, 64\) vs head \(64, 128\)"
    ):
        load(S | {q: torch.zeros(64, 64)})
    with pytest.raises(ValueError, match=r"shape mismatch for lm_head\.weight"):
        load(S | {"lm_head.weight": torch.zeros(128, 64)})
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        load(S | {"d2t": S["d2t"] + 200})
    with pytest.raises(ValueError, match=r"unexpected tensors: midlayer\.extra\.weight"):
        load(S | {"midlayer.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="norm_output"):
        LlamaForCausalLMEagle3(ModelConfig.from_hf_dict(cfg_d | {"norm_output": True}), MAX_POS)
    # A failed load writes nothing.
    head = LlamaForCausalLMEagle3(cfg, MAX_POS)
    before = head.fc.weight.clone()
    with pytest.raises(ValueError):
        head.load_weights(S | {q: torch.zeros(64, 64)})
    assert torch.equal(head.fc.weight, before)


@pytest.mark.parametrize("tied", [False, True])
def test_eagle3_full_vocab_head_uses_target_lm_head(tiny_llama3_dir, tied):
    target = load_target(tiny_llama3_dir)
    cfg_d, S = random_eagle_head(target.config, "EAGLE3", seed=8)
    del cfg_d["draft_vocab_size"]
    cfg_d.update(rope_scaling=None, tie_word_embeddings=tied)
    state = {n: t for n, t in S.items() if n not in ("lm_head.weight", "d2t", "t2d")}
    cfg = ModelConfig.from_hf_dict(cfg_d)
    head = LlamaForCausalLMEagle3(cfg, MAX_POS)
    head.load_weights(state)
    head.bind_target(target)
    h = torch.randn(2, 64)
    W = target.model.embed_tokens.weight if tied else target.lm_head.weight
    close(head.compute_logits(h), rms(h, S["norm.weight"], cfg.rms_norm_eps) @ W.detach().T)
    assert torch.equal(head.map_to_target_ids(torch.tensor([0, 77])), torch.tensor([0, 77]))


def test_eagle3_aux_layer_ids(tiny_llama3_dir):
    target = load_target(tiny_llama3_dir)
    cfg_d, S = random_eagle_head(target.config, "EAGLE3", draft_vocab_size=16, seed=9)
    cfg_d["rope_scaling"] = None
    assert LlamaForCausalLMEagle3(ModelConfig.from_hf_dict(cfg_d), MAX_POS).aux_layer_ids(32) == [2, 16, 29]
    cfg_d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [-1, 0, 1]}  # "output of layer i"
    head = LlamaForCausalLMEagle3(ModelConfig.from_hf_dict(cfg_d), MAX_POS)
    head.load_weights(S)
    head.bind_target(target)
    assert target.aux_layers == [0, 1, 2]


# ---------------------------------------------------------------- writers
def test_eagle_head_from_target_warm_start(tiny_llama3_dir, tmp_path):
    tstate = load_state_dict(tiny_llama3_dir, progress=False)
    tcfg = load_config(tiny_llama3_dir)
    target = load_target(tiny_llama3_dir)

    cfg1, S1 = eagle_head_from_target(tstate, tcfg, "EAGLE")
    save_eagle_head(tmp_path / "e1", cfg1, S1, fmt="bin", dtype=torch.float16)
    assert load_config(str(tmp_path / "e1")).hf_config["torch_dtype"] == "float16"
    head1 = load_head(str(tmp_path / "e1"), target)
    w = tstate["model.layers.2.self_attn.k_proj.weight"]
    assert torch.equal(head1.layers[0].self_attn.k_proj.weight, w.half().float())

    hot = torch.tensor([100, 2, 50, 7])
    cfg3, S3 = eagle_head_from_target(tstate, tcfg, "EAGLE3", draft_vocab_size=4, hot_ids=hot, layer=0)
    save_eagle_head(tmp_path / "e3", cfg3, S3)
    head3 = load_head(str(tmp_path / "e3"), target)
    assert head3.map_to_target_ids(torch.arange(4)).tolist() == [2, 7, 50, 100]
    assert torch.equal(head3.lm_head.weight, tstate["lm_head.weight"][[2, 7, 50, 100]])
    assert torch.equal(head3.norm.weight, tstate["model.norm.weight"])
    q = head3.midlayer.self_attn.q_proj.weight
    assert torch.equal(q[:, 64:], tstate["model.layers.0.self_attn.q_proj.weight"]) and not q[:, :64].any()
    with pytest.raises(FileExistsError):
        save_eagle_head(tmp_path / "e3", cfg3, S3, fmt="bin")
