"""Resolve ServerArgs into a complete, validated configuration before anything is loaded."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from treepage.arg_groups.speculative import resolve_speculative
from treepage.layers import cpu_linear
from treepage.layers.attention.registry import get_backend_class
from treepage.server_args import ArgumentError, ServerArgs

logger = logging.getLogger(__name__)

_DTYPE_ALIASES = {"float": "float32", "half": "float16"}
# CPU features with bf16 arithmetic in hardware: x86 AMX and AVX512-BF16, Arm BF16 (BFMMLA/BFDOT) and SVE BF16.
# Without one of them torch widens bf16 to fp32 in software, and bf16 matmuls run slower than fp32 ones.
NATIVE_BF16_FEATURES = ("amx_bf16", "avx512_bf16", "bf16", "sve_bf16")


def resolve_device(args: ServerArgs) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ArgumentError(
            "--device cuda was given but no CUDA device is available; allowed here: cpu, auto"
        )
    return args.device


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str


def choose_cpu_dtype(features: Mapping[str, object], bf16_kernels: bool = False) -> DtypeChoice:
    """`--dtype auto` on a CPU with these features (name -> present): bf16 where it is computed natively, or
    where treepage's own bf16 paths run (`bf16_kernels`: layers/cpu_linear.py's kernel built here), else fp32.

    "AVX512" alone is not enough: without BF16 torch emulates bf16 matmuls (4x slower than fp32 at 256
    rows). treepage's paths avoid that: few-row matmuls widen the bf16 weights in registers (reading half
    fp32's bytes), more rows run fp32 GEMMs on widened weights; there bf16 decodes 1.15-2.5x faster than fp32
    and prefills 4-8 % slower (docs/benchmarks_context.md, run 14).
    """
    native = [f for f in NATIVE_BF16_FEATURES if features.get(f)]
    if native:
        return DtypeChoice(
            torch.bfloat16, f"--dtype auto: the CPU computes bf16 natively ({', '.join(native)})"
        )
    if bf16_kernels:
        return DtypeChoice(
            torch.bfloat16,
            "--dtype auto: the CPU has no native bf16, but treepage's bf16 kernels run here (few-row "
            "matmuls widen bf16 weights in registers, the rest run as fp32 GEMMs): bf16 decodes faster than "
            "fp32",
        )
    return DtypeChoice(
        torch.float32,
        "--dtype auto: the CPU has no native bf16 (no AVX512-BF16, AMX or Arm BF16) and treepage's bf16 "
        "kernels do not run here (x86 with AVX2 + FMA and a C compiler), so bf16 matmuls would be emulated; "
        "fp32 is faster",
    )


def parse_cpuinfo_features(text: str) -> dict[str, bool]:
    """Feature names of the first CPU in /proc/cpuinfo text ("flags" on x86, "Features" on Arm)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return dict.fromkeys(value.split(), True)
    return {}


def cpu_features() -> dict[str, bool]:
    """The CPU's features as torch probes them at run time (torch.cpu.get_capabilities), else /proc/cpuinfo.

    (torch.backends.cpu.get_cpu_capability() names only the vector ISA torch dispatches to, "AVX512" with or
    without BF16, so it cannot answer this.)
    """
    get_caps = getattr(torch.cpu, "get_capabilities", None)
    if get_caps is not None:
        try:
            return {k: bool(v) for k, v in get_caps().items() if isinstance(v, bool)}
        except RuntimeError:
            pass
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo_features(f.read())
    except OSError:
        return {}


def within_torch_isa(features: Mapping[str, bool], capability: str) -> dict[str, bool]:
    """The features torch's vector ISA (torch.backends.cpu.get_cpu_capability()) lets it use: under "AVX2" or
    "DEFAULT" (ATEN_CPU_CAPABILITY on an AVX-512 CPU) no AVX-512 or AMX, as for the C kernels
    (layers/cpu_build.py)."""
    if capability in ("AVX2", "DEFAULT"):
        return {k: v for k, v in features.items() if not k.startswith(("avx512", "amx"))}
    return dict(features)


def dtype_choice(args: ServerArgs, device: str, treepage_kernels: bool = True) -> DtypeChoice:
    """`treepage_kernels` False: for work on torch's own matmuls (transformers, autograd: training), which
    treepage's bf16 kernels do not serve, so bf16 only where it is native."""
    name = _DTYPE_ALIASES.get(args.dtype, args.dtype)
    if name != "auto":
        return DtypeChoice(getattr(torch, name), f"--dtype {args.dtype}")
    if device == "cuda":
        return DtypeChoice(torch.bfloat16, "--dtype auto on CUDA")
    features = within_torch_isa(cpu_features(), torch.backends.cpu.get_cpu_capability())
    return choose_cpu_dtype(features, treepage_kernels and bf16_kernels())


def bf16_kernels() -> bool:
    """Whether treepage's bf16 linear kernel runs on this CPU (built at first use, layers/cpu_build.py)."""
    return cpu_linear.load() is not None


def resolve_dtype(args: ServerArgs, device: str) -> torch.dtype:
    choice = dtype_choice(args, device)
    logger.info("dtype %s (%s)", str(choice.dtype).removeprefix("torch."), choice.reason)
    return choice.dtype


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
