"""Model geometry, normalized from HF config.json (transformers 4.x or 5.x layout) or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "LlamaForCausalLMEagle", "LlamaForCausalLMEagle3"})
# Architectures whose checkpoints use the plain HF Llama tensor names (model.layers.N..., lm_head).
CAUSAL_LM_ARCHITECTURES = frozenset({"LlamaForCausalLM"})
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM"}


class UnsupportedArchitectureError(ValueError):
    def __init__(self, architecture: str):
        super().__init__(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
        self.architecture = architecture


def _as_id_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _split_rope(d: dict) -> tuple[float, dict | None]:
    """Returns (rope_theta, rope_scaling or None); accepts legacy rope_scaling and v5 rope_parameters."""
    params = dict(d.get("rope_parameters") or {})
    legacy = dict(d.get("rope_scaling") or {})
    thetas = (d.get("rope_theta"), params.pop("rope_theta", None), legacy.pop("rope_theta", None), 10000.0)
    theta = next(t for t in thetas if t is not None)
    scaling = legacy or params
    if "type" in scaling and "rope_type" not in scaling:  # transformers < 4.45 spelling
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if not scaling or scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None
    hf_config: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(d.get("model_type", ""), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(arch or f"<none; model_type={d.get('model_type')!r}>")
        heads = int(d["num_attention_heads"])
        rope_theta, rope_scaling = _split_rope(d)
        bos = d.get("bos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=_as_id_list(d.get("eos_token_id")),
            torch_dtype=d.get("torch_dtype", d.get("dtype")),
            hf_config=dict(d),
        )

    def to_hf_dict(self) -> dict:
        """Legacy-style keys (rope_theta + rope_scaling), which both transformers 4.x and 5.x accept."""
        out = {k: v for k, v in self.hf_config.items() if k not in ("rope_parameters", "rope_scaling")}
        eos = self.eos_token_ids
        out.update(
            architectures=[self.architecture],
            model_type="llama",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=(eos[0] if len(eos) == 1 else list(eos)) if eos else None,
        )
        return out
