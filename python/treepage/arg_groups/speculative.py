"""Speculative flag resolution and routing (docs/design.md, "Routing"). Every refusal happens here, at start-up."""

from __future__ import annotations

import logging

from treepage.layers.attention.registry import get_backend_class, paged_tree_backends
from treepage.server_args import ArgumentError, ServerArgs
from treepage.speculative.adaptive import AdaptiveConfig, TreeShape, default_candidates

logger = logging.getLogger(__name__)

# (steps, topk, draft tokens) when only the algorithm is given.
AUTO_TREE = {"STANDALONE": (3, 1, 4)}
AUTO_TREE_LLAMA = (5, 4, 8)
AUTO_TREE_OTHER = (3, 1, 4)


# What `make serve` runs with no flags: the bundled EAGLE-3 head, tree drafting on 64-token pages, spec v2.
# (steps, topk, draft tokens) chosen by measurement on the 2-core CPU (docs/training.md).
DEFAULT_SERVER_TREE = (4, 4, 16)
DEFAULT_SERVER_PAGE = 64


def apply_default_server_speculation(args: ServerArgs) -> None:
    """For the embedded default model with no --speculative-algorithm: EAGLE-3 with the shipped head.

    `--speculative-algorithm NONE` turns it off; explicit steps / topk / draft-token flags are kept and fix
    the shape; without them the shape adapts per round (`--speculative-adaptive`; `--no-speculative-adaptive`
    keeps the fixed default tree).
    """
    from treepage.models.shipped_heads import shipped_head_path

    if args.speculative_algorithm is not None:
        return
    args.speculative_algorithm = "EAGLE3"
    args.speculative_draft_model_path = args.speculative_draft_model_path or shipped_head_path("EAGLE3")
    if (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (
        None,
    ) * 3:
        S, K, N = DEFAULT_SERVER_TREE
        args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = S, K, N
        if args.speculative_adaptive is None:
            args.speculative_adaptive = True
    if args.page_size is None:
        args.page_size = DEFAULT_SERVER_PAGE


def max_tree_candidates(steps: int, topk: int) -> int:
    """Draft nodes a round can produce: K at step 0, K*K at each later step."""
    return topk + (steps - 1) * topk * topk


def resolve_speculative(args: ServerArgs, architecture: str = "LlamaForCausalLM") -> ServerArgs:
    """Fill defaults, refuse nonsense, choose spec v1/v2. Mutates and returns args."""
    P = args.page_size or 1
    if P & (P - 1) or not 1 <= P <= 1024:
        raise ArgumentError(f"--page-size must be a power of two in 1..1024, got {P}")
    if args.speculative_algorithm in (None, "NONE"):
        args.speculative_algorithm = None
        args.spec_version = 0
        flags: tuple[str, ...] = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
        if args.speculative_adaptive or args.speculative_adaptive_debug_cycle:
            flags += ("speculative_adaptive",)
        for flag in flags:
            if getattr(args, flag) is not None:
                raise ArgumentError(
                    f"--{flag.replace('_', '-')} needs --speculative-algorithm (EAGLE, EAGLE3 or STANDALONE)"
                )
        return args

    algo = args.speculative_algorithm
    S, K, N = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
    if S is None and K is None and N is None:
        S, K, N = AUTO_TREE.get(algo) or (
            AUTO_TREE_LLAMA if architecture == "LlamaForCausalLM" else AUTO_TREE_OTHER
        )
        logger.info("speculative tree chosen automatically: steps=%d topk=%d draft_tokens=%d", S, K, N)
    elif S is None:
        raise ArgumentError(
            "--speculative-num-steps must be given when --speculative-eagle-topk or "
            "--speculative-num-draft-tokens is given"
        )
    if S < 1:
        raise ArgumentError(f"--speculative-num-steps must be >= 1, got {S}")
    if K is None:
        K = 1
    if K < 1:
        raise ArgumentError(f"--speculative-eagle-topk must be >= 1, got {K}")
    if K == 1:
        if N is not None and N != S + 1:
            logger.warning(
                "topk == 1 makes the tree a chain: --speculative-num-draft-tokens %d -> %d", N, S + 1
            )
        N = S + 1
    if N is None:
        N = min(1 + max_tree_candidates(S, K), 2 * S * K)
    if N < 2:
        raise ArgumentError(f"--speculative-num-draft-tokens must be >= 2 (root + one draft), got {N}")
    if N - 1 > max_tree_candidates(S, K):
        raise ArgumentError(
            f"--speculative-num-draft-tokens {N} is larger than the tree can be: steps={S}, topk={K} give at "
            f"most 1 + K + (S-1)*K*K = {1 + max_tree_candidates(S, K)} tokens"
        )
    if algo in ("EAGLE", "EAGLE3", "STANDALONE") and not args.speculative_draft_model_path:
        raise ArgumentError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path")

    backend = args.attention_backend or "torch_native"
    if K > 1 and P > 1 and not get_backend_class(backend).supports_paged_tree_draft:
        raise ArgumentError(
            f"--speculative-eagle-topk {K} > 1 with --page-size {P} > 1 needs an attention backend with the paged "
            f"tree draft (cascade) path; --attention-backend {backend} has none. Allowed: "
            f"{', '.join(paged_tree_backends())}"
        )
    fixed = args.speculative_debug_fixed_accept_len
    if fixed is not None and not 1 <= fixed <= S + 1:
        raise ArgumentError(f"--speculative-debug-fixed-accept-len must be in 1..{S + 1}, got {fixed}")

    args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = S, K, N
    args.speculative_shapes = _resolve_shapes(args, TreeShape(S, K, N), P, backend)
    args.spec_version = 1 if args.disable_overlap_schedule else 2
    if args.max_running_requests is None:
        args.max_running_requests = 48
    return args


def _resolve_shapes(
    args: ServerArgs, configured: TreeShape, page_size: int, backend: str
) -> list[tuple[int, int, int]]:
    """The shapes rounds may use: the configured one, or every adaptive candidate (memory is sized for all)."""
    args.speculative_adaptive = bool(args.speculative_adaptive or args.speculative_adaptive_debug_cycle)
    if not args.speculative_adaptive:
        if args.speculative_adaptive_config or args.speculative_adaptive_calibration:
            raise ArgumentError(
                "--speculative-adaptive-config / --speculative-adaptive-calibration need --speculative-adaptive"
            )
        return [(configured.steps, configured.topk, configured.draft_tokens)]
    if args.speculative_debug_fixed_accept_len is not None:
        raise ArgumentError(
            "--speculative-debug-fixed-accept-len fixes one shape; it cannot be combined with "
            "--speculative-adaptive (pass --no-speculative-adaptive)"
        )
    if args.speculative_adaptive_config:
        try:
            cands = AdaptiveConfig.load(args.speculative_adaptive_config, configured).candidates
        except (OSError, ValueError, TypeError) as e:
            raise ArgumentError(f"--speculative-adaptive-config: {e}") from None
    else:
        cands = default_candidates(configured)
    if page_size > 1 and not get_backend_class(backend).supports_paged_tree_draft:
        wide = [c.label for c in cands if c.topk > 1]
        if wide:
            raise ArgumentError(
                f"--speculative-adaptive-config candidates {wide} have topk > 1 with --page-size {page_size}: "
                f"--attention-backend {backend} has no paged tree draft path"
            )
    logger.info("adaptive speculation over %s and off", ", ".join(c.label for c in cands))
    return [(c.steps, c.topk, c.draft_tokens) for c in cands]
