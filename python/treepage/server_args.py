"""ServerArgs: every launch flag, with SGLang's names. Resolution and validation live in arg_groups/."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
SPEC_ALGORITHMS = ("NONE", "EAGLE", "EAGLE3", "STANDALONE")


@dataclass
class ServerArgs:
    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    load_format: str = "auto"  # "dummy": random weights from config.json alone (benchmarks of big shapes)
    device: str = "auto"
    context_length: int | None = None
    page_size: int | None = None
    attention_backend: str | None = None
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    max_total_tokens: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None  # None: 8192 on CUDA, 512 on CPU; -1 or 0: never chunk
    mem_fraction_static: float | None = None
    cpu_kv_cache_gb: float = 1.0
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"  # "lru" | "lfu"
    random_seed: int | None = None
    log_level: str = "info"
    skip_server_warmup: bool = False
    # Speculative decoding
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    disable_overlap_schedule: bool = False
    # Debug: force every verify to accept this many tokens (root + drafts) regardless of the target,
    # so throughput can be measured without trained weights. Output is then NOT the target's.
    speculative_debug_fixed_accept_len: int | None = None
    # Adaptive speculation (speculative/adaptive.py): choose the tree shape, or plain decoding, every round.
    # None: on for the default server unless a fixed shape is given, off otherwise.
    speculative_adaptive: bool | None = None
    speculative_adaptive_config: str | None = None  # JSON: candidates, hysteresis, ...
    speculative_adaptive_calibration: str | None = None  # a cost-table JSON to load (or to write once)
    speculative_adaptive_debug_cycle: bool = False  # debug: a different shape every round, OFF included

    # Filled in by resolution (arg_groups): not flags.
    spec_version: int = 0  # 0 = no speculation, 1 = synchronous rounds, 2 = overlap scheduling
    # (steps, topk, draft tokens) of every shape a round may use; sizing takes the max over them.
    speculative_shapes: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)

    @property
    def speculation(self) -> bool:
        return self.speculative_algorithm not in (None, "NONE")


class ArgumentError(ValueError):
    """A start-up error that names the flag and the allowed values."""


class _Parser(argparse.ArgumentParser):
    # argparse prints usage and exits 2; keep that, with our prefix
    def error(self, message: str) -> NoReturn:
        self.print_usage()
        self.exit(2, f"treepage.launch_server: error: {message}\n")


def _positive_int(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} expects an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def make_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m treepage.launch_server", allow_abbrev=False)
    a = p.add_argument
    a("--model-path", "--model", dest="model_path", default=None)
    a("--tokenizer-path", default=None)
    a("--served-model-name", default=None)
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=30000)
    a("--dtype", choices=DTYPES, default="auto")
    a("--load-format", choices=("auto", "dummy"), default="auto")
    a("--device", choices=("auto", "cpu", "cuda"), default="auto")
    a("--context-length", type=_positive_int("--context-length"), default=None)
    a("--page-size", type=_positive_int("--page-size"), default=None)
    a("--attention-backend", default=None, help="torch_native, triton or sdpa (layers/attention/registry.py)")
    a("--max-running-requests", type=_positive_int("--max-running-requests"), default=None)
    a("--max-queued-requests", type=_positive_int("--max-queued-requests"), default=None)
    a("--max-total-tokens", type=_positive_int("--max-total-tokens"), default=None)
    a("--max-prefill-tokens", type=_positive_int("--max-prefill-tokens"), default=16384)
    a("--chunked-prefill-size", type=int, default=None, help="prefill long prompts in chunks of this many tokens")
    a("--mem-fraction-static", type=float, default=None)
    a(
        "--cpu-kv-cache-gb",
        type=float,
        default=1.0,
        help="KV pool byte budget on CPU when --max-total-tokens is unset",
    )
    a("--disable-radix-cache", action="store_true", help="no prefix cache: every request prefills its whole prompt")
    a("--radix-eviction-policy", choices=("lru", "lfu"), default="lru")
    a("--random-seed", type=int, default=None)
    a("--log-level", choices=("debug", "info", "warning", "error", "critical"), default="info")
    a("--skip-server-warmup", action="store_true")
    a("--speculative-algorithm", type=str.upper, choices=SPEC_ALGORITHMS, default=None)
    a("--speculative-draft-model-path", "--speculative-draft-model", dest="speculative_draft_model_path")
    a("--speculative-num-steps", type=int, default=None)
    a("--speculative-eagle-topk", type=int, default=None)
    a("--speculative-num-draft-tokens", type=int, default=None)
    a("--disable-overlap-schedule", action="store_true")
    a("--speculative-debug-fixed-accept-len", type=int, default=None)
    a(
        "--speculative-adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="choose the tree shape (or plain decoding) every round from a measured cost model; on by default "
        "for the default server",
    )
    a("--speculative-adaptive-config", default=None, help="JSON file: candidates [[S, K, N], ...], hysteresis")
    a("--speculative-adaptive-calibration", default=None, help="cost-table JSON to reuse (written if missing)")
    a("--speculative-adaptive-debug-cycle", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = make_parser().parse_args(argv)
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in fields})
