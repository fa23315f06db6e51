"""Builds the worker the flags ask for: plain, spec v1 or spec v2 (the one place that sees all three)."""

from __future__ import annotations

import torch

from treepage.managers.tp_worker import TpWorker
from treepage.model_executor.model_runner import ModelRunner, kv_bytes_per_token
from treepage.model_executor.worker import Worker
from treepage.models.config import ModelConfig
from treepage.models.llama import LlamaForCausalLM
from treepage.models.loader import load_config
from treepage.server_args import ServerArgs
from treepage.speculative.eagle_worker import EagleWorker
from treepage.speculative.eagle_worker_v2 import EagleWorkerV2

_HEAD_ARCHITECTURES = {"EAGLE": "LlamaForCausalLMEagle", "EAGLE3": "LlamaForCausalLMEagle3"}


def build_worker(args: ServerArgs, config: ModelConfig, dtype: torch.dtype) -> Worker:
    assert args.model_path is not None
    if not args.speculation:
        return TpWorker(ModelRunner(args, args.model_path, dtype, config=config))
    assert args.speculative_draft_model_path is not None and args.speculative_algorithm is not None
    draft_config = load_config(args.speculative_draft_model_path)
    head = _HEAD_ARCHITECTURES.get(args.speculative_algorithm)
    if head and draft_config.architecture != head:
        # The original EAGLE-1 releases say "LlamaForCausalLM"; the algorithm flag says what the weights are.
        draft_config.architecture = head
    target = ModelRunner(
        args,
        args.model_path,
        dtype,
        config=config,
        draft_bytes_per_token=kv_bytes_per_token(draft_config, dtype),
    )
    draft = ModelRunner(
        args, args.speculative_draft_model_path, dtype, pools=target.pools, config=draft_config
    )
    if not isinstance(draft.model, LlamaForCausalLM):  # a head reads the target's embedding and LM head
        assert isinstance(target.model, LlamaForCausalLM)
        draft.model.bind_target(target.model)
    cls = EagleWorkerV2 if args.spec_version == 2 else EagleWorker
    return cls(args, target, draft)
