"""EAGLE-1/2 draft head: fc(concat(target embedding, feature)) -> one Llama layer without input norm.

Parameter names equal the released checkpoint names (`fc.*`, `layers.0.*`). The embedding and the LM head are
the target's, shared by `bind_target`; any copy in the checkpoint is ignored.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from treepage.layers.forward_batch import ForwardBatch, ModelOutput
from treepage.layers.linear import Linear
from treepage.layers.norm import RMSNorm
from treepage.layers.rope import RotaryEmbedding
from treepage.models.config import ModelConfig
from treepage.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

# Checkpoint entries no head ever reads (old transformers serialized RoPE tables).
_ALWAYS_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def copy_released_weights(
    head: str,
    expected: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    optional: Iterable[str] = (),
) -> None:
    """Copy `state` into `expected` (released name -> tensor), after checking names and shapes first.

    Nothing is written unless the whole checkpoint matches, so a failed load leaves the module unchanged.
    """

    def show(names: list[str]) -> str:
        return ", ".join(names[:8]) + (f" ... (+{len(names) - 8} more)" if len(names) > 8 else "")

    missing = sorted(n for n in expected if n not in state and n not in set(optional))
    unexpected = sorted(n for n in state if n not in expected)
    problems = []
    if missing:
        problems.append(f"missing tensors: {show(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {show(unexpected)}")
    for name in sorted(n for n in state if n in expected):
        want, got = tuple(expected[name].shape), tuple(state[name].shape)
        if want != got:
            problems.append(f"shape mismatch for {name}: checkpoint {got} vs head {want}")
    if problems:
        raise ValueError(f"cannot load {head} draft head: " + "; ".join(problems))
    with torch.no_grad():
        for name, src in state.items():
            dst = expected[name]
            dst.copy_(src.to(dst.dtype))


def strip_model_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Some re-uploads prefix every name with `model.`; the released heads do not."""
    return {n.removeprefix("model."): t for n, t in state.items() if not n.endswith(_ALWAYS_IGNORED_SUFFIXES)}


class EagleDecoderLayer(nn.Module):
    """A Llama decoder layer without the pre-attention norm: the fc output goes straight into attention."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, 0, rope)  # layer 0 of the draft KV pool
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, z: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        h = z + self.self_attn(positions, z, fb)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLMEagle(nn.Module):
    """forward() returns the recurrent state h2 [T, H]; compute_logits applies the target LM head (no norm)."""

    feature_kind: str = "last"

    def __init__(self, config: ModelConfig, max_position: int) -> None:
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(f"an EAGLE head has one decoder layer, config says {config.num_hidden_layers}")
        self.config = config
        H = config.hidden_size
        # A missing "bias" key means the fc has a bias (LLaMA-2 / Vicuna heads).
        self.fc = Linear(2 * H, H, bias=bool(config.hf_config.get("bias", True)))
        self.rope = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList([EagleDecoderLayer(config, self.rope)])
        self.embed_tokens: nn.Embedding | None = None  # the target's, set by bind_target
        self.lm_head: nn.Linear | None = None

    def _own_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {f"fc.{n}": p for n, p in self.fc.named_parameters()}
        out.update({f"layers.0.{n}": p for n, p in self.layers[0].named_parameters()})
        return out

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        state = strip_model_prefix(state)
        # The target's embedding and LM head replace any copy shipped with the head.
        state = {n: t for n, t in state.items() if n not in ("embed_tokens.weight", "lm_head.weight")}
        if "fc.bias" in state and self.fc.bias is None:
            raise ValueError(
                'cannot load EAGLE draft head: checkpoint has fc.bias but config.json sets "bias": false'
            )
        copy_released_weights("EAGLE", self._own_tensors(), state)

    def bind_target(self, target: LlamaForCausalLM) -> None:
        embed, lm_head = target.model.embed_tokens, target.lm_head
        if embed.weight.shape[1] != self.config.hidden_size:
            raise ValueError(
                f"EAGLE head hidden size {self.config.hidden_size} != target hidden size {embed.weight.shape[1]}"
            )
        self.embed_tokens, self.lm_head = embed, lm_head

    def forward(self, fb: ForwardBatch) -> ModelOutput:
        if self.embed_tokens is None:
            raise RuntimeError("EAGLE head: call bind_target(target) before forward")
        f = fb.input_hidden
        H = self.config.hidden_size
        if f is None or f.shape[-1] != H:
            width = None if f is None else f.shape[-1]
            raise ValueError(
                f"EAGLE head needs input_hidden of width {H} (target feature or own state), got {width}"
            )
        e = self.embed_tokens(fb.input_ids)
        z = self.fc(torch.cat([e, f.to(e.dtype)], dim=-1))  # embedding first, feature second
        return ModelOutput(self.layers[0](fb.positions, z, fb))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("EAGLE head: call bind_target(target) before compute_logits")
        return self.lm_head(hidden).float()

    def map_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids
