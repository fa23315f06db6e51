"""Llama-family decoder (RMSNorm, RoPE incl. Llama-3 scaling, GQA, SwiGLU, tied or untied embeddings)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treepage.layers.forward_batch import CaptureHidden, ForwardBatch, ModelOutput
from treepage.layers.linear import Linear, fuse_linears, linear, use_fused
from treepage.layers.norm import RMSNorm
from treepage.layers.rope import RotaryEmbedding
from treepage.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, rope: RotaryEmbedding, in_features: int | None = None
    ):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        in_features = in_features or hidden
        bias = bool(config.hf_config.get("attention_bias", False))
        self.q_proj = Linear(in_features, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.scaling = self.head_dim**-0.5
        self.rope = rope
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse_projections()

    def fuse_projections(self) -> None:
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        if self.qkv is not None and use_fused(x):
            q, k, v = linear(x, *self.qkv).split(
                [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], dim=-1
            )
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rope(positions, q, k)
        o = fb.attn_backend.forward(q, k, v, self.layer_id, self.scaling, fb)
        return self.o_proj(o.reshape(T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse_projections()

    def fuse_projections(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and use_fused(x):
            gate, up = linear(x, *self.gate_up).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rope)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h), fb)
        return h + self.mlp(self.post_attention_layernorm(h))


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3 default capture points: the inputs of layers 2, L//2 and L-3 (0-indexed; clamped for tiny models)."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rope = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling)
        self.rope = rope
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i, rope) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward() returns final-norm hidden states [T, H] and the features fb.capture_hidden asks for; logits come
    from compute_logits on chosen rows."""

    def __init__(self, config: ModelConfig, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_position or config.max_position_embeddings)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.aux_layers = default_aux_layers(config.num_hidden_layers)

    def forward(self, fb: ForwardBatch) -> ModelOutput:
        h = self.model.embed_tokens(fb.input_ids)
        aux: dict[int, torch.Tensor] = {}
        capture_aux = fb.capture_hidden == CaptureHidden.AUX
        for i, layer in enumerate(self.model.layers):
            if capture_aux and i in self.aux_layers:
                aux[i] = h
            h = layer(fb.positions, h, fb)
        if capture_aux and len(self.model.layers) in self.aux_layers:
            aux[len(self.model.layers)] = h
        h = self.model.norm(h)
        if capture_aux:
            return ModelOutput(h, torch.cat([aux[i] for i in self.aux_layers], dim=-1))
        return ModelOutput(h, h if fb.capture_hidden == CaptureHidden.LAST else None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
