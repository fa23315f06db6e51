"""EAGLE-3 draft head: fc fuses three target layers; one layer attends over concat(norm(embedding), norm(state)).

Parameter and buffer names equal the released checkpoint names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`); `layers.0.*` is accepted for `midlayer.*`. The token embedding is the target's (bind_target).
"""

from __future__ import annotations

import torch
from torch import nn

from treepage.layers.forward_batch import ForwardBatch, ModelOutput
from treepage.layers.linear import Linear
from treepage.layers.norm import RMSNorm
from treepage.layers.rope import RotaryEmbedding
from treepage.models.config import ModelConfig
from treepage.models.eagle_checkpoint import hot_ids_from_d2t
from treepage.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from treepage.models.llama_eagle import copy_released_weights, strip_model_prefix

# Third-party options whose tensors and semantics the released heads do not use; refused rather than guessed.
_UNSUPPORTED_FLAGS = ("fc_norm", "use_aux_norm", "norm_output")
_UNSUPPORTED_EAGLE_FLAGS = ("norm_before_fc",)


def _check_supported(config: ModelConfig) -> None:
    d = config.hf_config
    eagle = d.get("eagle_config") or {}
    on = [k for k in _UNSUPPORTED_FLAGS if d.get(k)] + [
        f"eagle_config.{k}" for k in _UNSUPPORTED_EAGLE_FLAGS if eagle.get(k)
    ]
    if not eagle.get("use_aux_hidden_state", True):
        on.append("eagle_config.use_aux_hidden_state=false")
    ths = d.get("target_hidden_size")
    if ths is not None and int(ths) != config.hidden_size:
        on.append(f"target_hidden_size={ths} != hidden_size={config.hidden_size} (head-owned embedding)")
    if on:
        raise ValueError(f"EAGLE-3 head config uses options treepage does not support: {', '.join(on)}")


class Eagle3DecoderLayer(nn.Module):
    """Attention reads the 2H-wide concat(input_layernorm(embedding), hidden_norm(state)); residual is the state."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_norm = RMSNorm(H, eps)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = LlamaAttention(config, 0, rope, in_features=2 * H)  # layer 0 of the draft KV pool
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = LlamaMLP(H, config.intermediate_size)

    def forward(
        self, positions: torch.Tensor, e: torch.Tensor, g: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        u = torch.cat([self.input_layernorm(e), self.hidden_norm(g)], dim=-1)  # embedding first
        h = g + self.self_attn(positions, u, fb)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLMEagle3(nn.Module):
    """forward() returns the pre-norm state h2 [T, H]; compute_logits = lm_head(norm(h2)) over the draft vocab."""

    feature_kind: str = "aux"
    d2t: torch.Tensor  # [Vd] buffer: target id = draft id + d2t[draft id]
    t2d: torch.Tensor  # [V] buffer: is the target id in the draft vocabulary

    def __init__(self, config: ModelConfig, max_position: int) -> None:
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(f"an EAGLE-3 head has one decoder layer, config says {config.num_hidden_layers}")
        _check_supported(config)
        self.config = config
        d = config.hf_config
        H, V = config.hidden_size, config.vocab_size
        # A null/absent draft_vocab_size means the full target vocabulary, with the LM head possibly the target's.
        self.full_vocab_head = d.get("draft_vocab_size") is None
        self.draft_vocab_size = V if self.full_vocab_head else int(d["draft_vocab_size"])
        if not 0 < self.draft_vocab_size <= V:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size={V}")
        if config.tie_word_embeddings and self.draft_vocab_size != V:
            raise ValueError("tie_word_embeddings needs draft_vocab_size == vocab_size")
        self.num_aux = int(d.get("num_aux_hidden_states") or 3)
        self.feature_width = self.num_aux * H
        if self.feature_width == H:
            raise ValueError("num_aux_hidden_states=1 makes target features and own states indistinguishable")
        self.fc = Linear(self.feature_width, H, bias=bool(d.get("bias", False)))
        self.rope = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling)
        self.midlayer = Eagle3DecoderLayer(config, self.rope)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = (
            None if config.tie_word_embeddings else Linear(H, self.draft_vocab_size, bias=False)
        )
        self._lm_head_from_target = config.tie_word_embeddings
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.full((V,), self.draft_vocab_size == V, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None  # the target's, set by bind_target

    def aux_layer_ids(self, num_target_layers: int) -> list[int]:
        """Target layers whose inputs are captured: explicit ids mean "output of layer i", i.e. input of i+1."""
        ids = (self.config.hf_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids:
            return [int(i) + 1 for i in ids]
        return [2, num_target_layers // 2, num_target_layers - 3]

    def _own_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {f"fc.{n}": p for n, p in self.fc.named_parameters()}
        out.update({f"midlayer.{n}": p for n, p in self.midlayer.named_parameters()})
        out["norm.weight"] = self.norm.weight
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head.weight
        out.update(d2t=self.d2t, t2d=self.t2d)
        return out

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        V, Vd = self.config.vocab_size, self.draft_vocab_size
        state = {
            ("midlayer." + n[len("layers.0.") :] if n.startswith("layers.0.") else n): t
            for n, t in strip_model_prefix(state).items()
            if n != "embed_tokens.weight"  # frozen copy of the target embedding, when a trainer saved it
        }
        optional = {"t2d"} | ({"d2t"} if Vd == V else set())
        # A full-vocabulary head that ships no lm_head uses the target's (SGLang does the same).
        from_target = self.config.tie_word_embeddings or (
            self.full_vocab_head and "lm_head.weight" not in state
        )
        expected = self._own_tensors()
        if from_target:
            expected.pop("lm_head.weight", None)
            state = {n: t for n, t in state.items() if n != "lm_head.weight"}
        copy_released_weights("EAGLE-3", expected, state, optional)
        self._lm_head_from_target = from_target
        if "d2t" in state:
            hot = hot_ids_from_d2t(self.d2t)
            if Vd and (int(hot.min()) < 0 or int(hot.max()) >= V):
                raise ValueError(f"EAGLE-3 d2t maps draft ids outside the target vocabulary 0..{V - 1}")
            if "t2d" not in state:
                self.t2d.zero_()
                self.t2d[hot] = True

    def bind_target(self, target: LlamaForCausalLM) -> None:
        embed = target.model.embed_tokens
        if embed.weight.shape != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"EAGLE-3 head expects a target embedding of shape {(self.config.vocab_size, self.config.hidden_size)}, "
                f"target has {tuple(embed.weight.shape)}"
            )
        self.embed_tokens = embed
        if self.config.tie_word_embeddings:
            self.lm_head = Linear(self.config.hidden_size, self.config.vocab_size, bias=False, device="meta")
            self.lm_head.weight = embed.weight
        elif self._lm_head_from_target:
            self.lm_head = target.lm_head
        ids = (self.config.hf_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids and hasattr(target, "aux_layers"):
            target.aux_layers = self.aux_layer_ids(len(target.model.layers))

    def forward(self, fb: ForwardBatch) -> ModelOutput:
        if self.embed_tokens is None:
            raise RuntimeError("EAGLE-3 head: call bind_target(target) before forward")
        g = fb.input_hidden
        H = self.config.hidden_size
        e = self.embed_tokens(fb.input_ids)
        if g is None or g.shape[-1] not in (self.feature_width, H):
            width = None if g is None else g.shape[-1]
            raise ValueError(
                f"EAGLE-3 head needs input_hidden of width {self.feature_width} (target features) or {H} "
                f"(own state), got {width}"
            )
        g = g.to(e.dtype)
        if g.shape[-1] == self.feature_width:  # target features are fused once; own states skip fc
            g = self.fc(g)
        return ModelOutput(self.midlayer(fb.positions, e, g, fb))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("EAGLE-3 head: call bind_target(target) before compute_logits")
        return self.lm_head(self.norm(hidden)).float()

    def map_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
