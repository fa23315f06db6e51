"""Writers for EAGLE / EAGLE-3 draft heads in exactly the released layout (config.json + one weight file).

EAGLE-1 names: fc.{weight,bias}, layers.0.{self_attn,mlp,post_attention_layernorm}.* (no embedding, no LM head).
EAGLE-3 names: fc.weight, midlayer.{hidden_norm,input_layernorm,self_attn,post_attention_layernorm,mlp}.*,
norm.weight, lm_head.weight [Vd, H], d2t int64 [Vd] (target id = draft id + d2t), t2d bool [V].
"""

from __future__ import annotations

import json
import math
import os
from typing import Literal

import torch

from treepage.models.config import ModelConfig

Algorithm = Literal["EAGLE", "EAGLE3"]
_ARCH = {"EAGLE": "LlamaForCausalLMEagle", "EAGLE3": "LlamaForCausalLMEagle3"}
_WEIGHT_FILES = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in _ARCH:
        raise ValueError(f"algorithm must be one of {sorted(_ARCH)}, got {algorithm!r}")


def head_config_dict(
    target_config: ModelConfig,
    algorithm: Algorithm,
    draft_vocab_size: int | None = None,
    bias: bool | None = None,
) -> dict:
    """A single-layer Llama config with the target's geometry; `bias` is written only when given explicitly
    (a missing key means True for EAGLE-1, False for EAGLE-3, as in the released heads)."""
    _check_algorithm(algorithm)
    t = target_config
    d = {
        "architectures": [_ARCH[algorithm]],
        "model_type": "llama",
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "vocab_size": t.vocab_size,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": t.rope_theta,
        "rope_scaling": dict(t.rope_scaling) if t.rope_scaling else None,
        "max_position_embeddings": t.max_position_embeddings,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    if bias is not None:
        d["bias"] = bool(bias)
    if algorithm == "EAGLE3":
        d["draft_vocab_size"] = t.vocab_size if draft_vocab_size is None else int(draft_vocab_size)
    elif draft_vocab_size is not None:
        raise ValueError("draft_vocab_size applies to EAGLE3 heads only")
    return d


def head_tensor_shapes(config_dict: dict) -> dict[str, tuple[int, ...]]:
    """Released tensor names and shapes for a head config (floating tensors only; d2t/t2d not included)."""
    eagle3 = config_dict["architectures"][0] == _ARCH["EAGLE3"]
    H, I = config_dict["hidden_size"], config_dict["intermediate_size"]
    nh, nkv = config_dict["num_attention_heads"], config_dict["num_key_value_heads"]
    hd = config_dict.get("head_dim") or H // nh
    attn_in = 2 * H if eagle3 else H
    p = "midlayer." if eagle3 else "layers.0."
    shapes = {
        "fc.weight": (H, (config_dict.get("num_aux_hidden_states") or 3) * H if eagle3 else 2 * H),
        p + "self_attn.q_proj.weight": (nh * hd, attn_in),
        p + "self_attn.k_proj.weight": (nkv * hd, attn_in),
        p + "self_attn.v_proj.weight": (nkv * hd, attn_in),
        p + "self_attn.o_proj.weight": (H, nh * hd),
        p + "mlp.gate_proj.weight": (I, H),
        p + "mlp.up_proj.weight": (I, H),
        p + "mlp.down_proj.weight": (H, I),
        p + "post_attention_layernorm.weight": (H,),
    }
    if config_dict.get("bias", not eagle3):
        shapes["fc.bias"] = (H,)
    if eagle3:
        Vd = config_dict.get("draft_vocab_size") or config_dict["vocab_size"]
        shapes.update(
            {
                p + "hidden_norm.weight": (H,),
                p + "input_layernorm.weight": (H,),
                "norm.weight": (H,),
                "lm_head.weight": (Vd, H),
            }
        )
    return shapes


def draft_vocab_maps(hot_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for a draft vocabulary given as target ids; draft id i is the i-th smallest hot id."""
    hot = torch.unique(hot_ids.long())  # sorted ascending, duplicates dropped
    if hot.numel() != hot_ids.numel():
        raise ValueError("draft vocabulary ids must be distinct")
    if hot.numel() and (int(hot[0]) < 0 or int(hot[-1]) >= vocab_size):
        raise ValueError(f"draft vocabulary ids must lie in 0..{vocab_size - 1}")
    d2t = hot - torch.arange(hot.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[hot] = True
    return d2t, t2d


def hot_ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids of a draft vocabulary from its d2t (draft id i + d2t[i]): draft_vocab_maps' inverse."""
    return d2t.long() + torch.arange(d2t.numel(), device=d2t.device)


def hot_ids_from_counts(
    counts: torch.Tensor, draft_vocab_size: int, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """The draft_vocab_size most frequent target ids (ties: lower id first), sorted ascending. With `keep`
    (the ids of a smaller draft vocabulary being widened): those ids, then the most frequent others."""
    score = counts.double()
    if keep is not None:
        if keep.numel() > draft_vocab_size:
            raise ValueError(f"cannot keep {keep.numel()} ids in a draft vocabulary of {draft_vocab_size}")
        score = score.clone()
        score[keep.long()] = math.inf
    order = torch.argsort(-score, stable=True)
    return torch.sort(order[:draft_vocab_size]).values


def eagle_head_from_target(
    target_state: dict[str, torch.Tensor],
    target_config: ModelConfig,
    algorithm: Algorithm,
    draft_vocab_size: int | None = None,
    hot_ids: torch.Tensor | None = None,
    layer: int | None = None,
    bias: bool | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Warm start: copy one target decoder layer (default: the last) into the head.

    fc starts as a pass-through of the feature (EAGLE-1: the feature half; EAGLE-3: the high-layer chunk), the
    attention reads the state half only, and an EAGLE-3 head gets the target's final norm and the LM-head rows
    of its draft vocabulary (`hot_ids`, default the first draft_vocab_size ids).
    """
    cfg = head_config_dict(target_config, algorithm, draft_vocab_size, bias)
    H, V = target_config.hidden_size, target_config.vocab_size
    L = target_config.num_hidden_layers
    layer = L - 1 if layer is None else layer
    if not 0 <= layer < L:
        raise ValueError(f"layer {layer} out of range 0..{L - 1}")
    src = f"model.layers.{layer}."
    eagle3 = algorithm == "EAGLE3"
    p = "midlayer." if eagle3 else "layers.0."
    shapes = head_tensor_shapes(cfg)
    state: dict[str, torch.Tensor] = {}
    for name in shapes:
        if name.startswith(p) and not name.startswith((p + "hidden_norm", p + "input_layernorm")):
            w = target_state[src + name[len(p) :]].float().clone()
            if eagle3 and name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                w = torch.cat([torch.zeros_like(w), w], dim=1)  # [embedding half | state half]
            state[name] = w
    eye = torch.eye(H)
    chunks = 3 if eagle3 else 2
    state["fc.weight"] = torch.cat([torch.zeros(H, H)] * (chunks - 1) + [eye], dim=1)
    if "fc.bias" in shapes:
        state["fc.bias"] = torch.zeros(H)
    if eagle3:
        state[p + "hidden_norm.weight"] = target_state[src + "input_layernorm.weight"].float().clone()
        state[p + "input_layernorm.weight"] = torch.ones(H)
        state["norm.weight"] = target_state["model.norm.weight"].float().clone()
        Vd = cfg["draft_vocab_size"]
        hot = torch.arange(Vd) if hot_ids is None else hot_ids
        if hot.numel() != Vd:
            raise ValueError(f"hot_ids has {hot.numel()} ids, draft_vocab_size is {Vd}")
        d2t, t2d = draft_vocab_maps(hot, V)
        head = target_state.get("lm_head.weight", target_state["model.embed_tokens.weight"])
        state["lm_head.weight"] = head.float()[hot_ids_from_d2t(d2t)].clone()
        state["d2t"], state["t2d"] = d2t, t2d
    return cfg, state


def save_eagle_head(
    path: str | os.PathLike,
    config_dict: dict,
    state_dict: dict[str, torch.Tensor],
    fmt: Literal["safetensors", "bin"] = "safetensors",
    dtype: torch.dtype | None = None,
) -> None:
    """Write config.json plus model.safetensors or pytorch_model.bin; floats are cast to dtype when given."""
    if fmt not in _WEIGHT_FILES:
        raise ValueError(f"fmt must be one of {sorted(_WEIGHT_FILES)}, got {fmt!r}")
    os.makedirs(path, exist_ok=True)
    other = os.path.join(path, _WEIGHT_FILES["bin" if fmt == "safetensors" else "safetensors"])
    if os.path.exists(other):
        raise FileExistsError(f"{other} exists; a head directory holds one weight file")
    # Own, contiguous storage per tensor: safetensors refuses shared or strided tensors.
    tensors = {
        n: (t.to(dtype) if dtype is not None and t.is_floating_point() else t)
        .detach()
        .cpu()
        .contiguous()
        .clone()
        for n, t in state_dict.items()
    }
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    config_dict = dict(config_dict)
    if len(floats) == 1:
        config_dict["torch_dtype"] = str(floats.pop()).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_dict, f, indent=2)
    weights = os.path.join(path, _WEIGHT_FILES[fmt])
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, weights, metadata={"format": "pt"})
    else:
        torch.save(tensors, weights)
