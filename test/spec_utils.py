"""Checkpoints for speculative tests: a sharp tiny target and drafts that agree with it often, not always."""

from __future__ import annotations

import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from conftest import _save_tiny_llama
from treepage.entrypoints.engine import Engine
from treepage.models.config import ModelConfig
from treepage.server_args import ServerArgs


def make_sharp_target(out_dir: str, seed: int = 0, num_layers: int = 4, sharpen: float = 4.0) -> str:
    """A tiny random Llama whose final norm is scaled up: peaked next-token distributions, like a real model's,
    so greedy chains are stable and a draft close to it is accepted deep into the tree."""
    _save_tiny_llama(out_dir, seed=seed, num_hidden_layers=num_layers)
    path = os.path.join(out_dir, "model.safetensors")
    sd = load_file(path)
    sd["model.norm.weight"] = sd["model.norm.weight"] * sharpen
    save_file(sd, path, metadata={"format": "pt"})
    return out_dir


def make_perturbed_copy(target_dir: str, out_dir: str, noise: float, seed: int = 1) -> str:
    """A STANDALONE draft: the target's weights plus Gaussian noise."""
    shutil.copytree(target_dir, out_dir, dirs_exist_ok=True)
    path = os.path.join(out_dir, "model.safetensors")
    sd = load_file(path)
    g = torch.Generator().manual_seed(seed)
    sd = {k: (v + noise * torch.randn(v.shape, generator=g)).contiguous() for k, v in sd.items()}
    save_file(sd, path, metadata={"format": "pt"})
    return out_dir


def make_eagle_head(
    target_dir: str,
    out_dir: str,
    algorithm: str,
    seed: int = 0,
    draft_vocab_size: int | None = None,
    never_draft: tuple[int, ...] = (),
) -> str:
    """`never_draft`: target ids left out of an EAGLE-3 draft vocabulary, so the draft can never propose them."""
    from treepage.models.eagle_checkpoint import save_eagle_head
    from treepage.models.loader import load_config

    cfg, state = random_eagle_head(load_config(target_dir), algorithm, draft_vocab_size, seed, never_draft=never_draft)
    save_eagle_head(out_dir, cfg, state)
    for name in os.listdir(target_dir):  # heads ship without a tokenizer; the target's is used
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(target_dir, name), out_dir)
    return out_dir


def random_eagle_head(
    target_config: ModelConfig,
    algorithm: str,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    bias: bool | None = None,
    never_draft: tuple[int, ...] = (),
) -> tuple[dict, dict[str, torch.Tensor]]:
    """A random head (fp32) in the released layout; an EAGLE-3 draft vocab is a random sorted subset of ids."""
    from treepage.models.eagle_checkpoint import draft_vocab_maps, head_config_dict, head_tensor_shapes

    cfg = head_config_dict(target_config, algorithm, draft_vocab_size, bias)
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in head_tensor_shapes(cfg).items():
        if len(shape) == 1 and name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif len(shape) == 1:
            state[name] = 0.1 * torch.randn(shape, generator=g)
        else:
            state[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
    if algorithm == "EAGLE3":
        V, Vd = cfg["vocab_size"], cfg["draft_vocab_size"]
        allowed = torch.tensor([t for t in torch.randperm(V, generator=g).tolist() if t not in never_draft])
        hot = torch.sort(allowed[:Vd]).values
        state["d2t"], state["t2d"] = draft_vocab_maps(hot, V)
    return cfg, state


SPEC_TREES = {1: (3, 1, 4), 4: (4, 4, 12), 8: (4, 8, 16)}  # topk -> (steps, topk, draft tokens)


def standalone_engine(target: str, draft: str, topk: int, page: int, version: int, **kw) -> Engine:
    """An fp32 STANDALONE speculative engine with the tree of SPEC_TREES[topk]; version 1 (no overlap) or 2."""
    steps, k, n = SPEC_TREES[topk]
    return Engine(
        ServerArgs(
            model_path=target,
            dtype="float32",
            page_size=page,
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=draft,
            speculative_num_steps=steps,
            speculative_eagle_topk=k,
            speculative_num_draft_tokens=n,
            disable_overlap_schedule=version == 1,
            **kw,
        )
    )


def assert_no_leak(eng: Engine) -> None:
    """Idle engine, nothing held: no pages, rows or prefix-cache locks in use (no cached pages when the cache is
    off), the scheduler's own accounting check passes, and the engine is still serving."""
    eng.wait_idle()
    mem = eng.memory_report()
    assert mem["used_pages"] == 0 and mem["used_rows"] == 0 and mem["locked_pages"] == 0, mem
    if not mem["radix_cache"]:
        assert mem["cached_pages"] == 0, mem
    eng.scheduler.check_memory()
    assert eng.is_alive()
