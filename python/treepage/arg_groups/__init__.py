"""Resolve ServerArgs into a complete, validated configuration before anything is loaded."""

from __future__ import annotations

import torch

from treepage.arg_groups.speculative import resolve_speculative
from treepage.layers.attention.registry import get_backend_class
from treepage.server_args import ArgumentError, ServerArgs

_DTYPE_ALIASES = {"float": "float32", "half": "float16"}


def resolve_device(args: ServerArgs) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ArgumentError(
            "--device cuda was given but no CUDA device is available; allowed here: cpu, auto"
        )
    return args.device


def resolve_dtype(args: ServerArgs, device: str) -> torch.dtype:
    name = _DTYPE_ALIASES.get(args.dtype, args.dtype)
    if name == "auto":
        if device == "cuda":
            return torch.bfloat16
        # bf16 matmuls are fast only with native bf16 support on the CPU (AVX512-BF16 / AMX).
        return torch.bfloat16 if "AVX512" in torch.backends.cpu.get_cpu_capability() else torch.float32
    return getattr(torch, name)


def resolve_server_args(args: ServerArgs, architecture: str = "LlamaForCausalLM") -> ServerArgs:
    args.device = resolve_device(args)
    if args.attention_backend is None:
        args.attention_backend = "triton" if args.device == "cuda" else "torch_native"
    get_backend_class(args.attention_backend)  # an unknown name fails here, naming the flag
    if args.page_size is None:
        args.page_size = 1
    if not 1 <= args.port <= 65535:
        raise ArgumentError(f"--port must be in 1..65535, got {args.port}")
    if args.mem_fraction_static is not None and not 0.0 < args.mem_fraction_static < 1.0:
        raise ArgumentError(f"--mem-fraction-static must be in (0, 1), got {args.mem_fraction_static}")
    if args.cpu_kv_cache_gb <= 0:
        raise ArgumentError(f"--cpu-kv-cache-gb must be > 0, got {args.cpu_kv_cache_gb}")
    resolve_speculative(args, architecture)
    if args.chunked_prefill_size is None:
        # One chunk is the longest a long prompt may stall the running requests' decode.
        args.chunked_prefill_size = 8192 if args.device == "cuda" else 512
    elif args.chunked_prefill_size <= 0:
        args.chunked_prefill_size = -1
    if args.max_running_requests is None:
        args.max_running_requests = 32
    return args
