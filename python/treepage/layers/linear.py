"""The models' linear layers: the CPU's bf16 paths where they serve (cpu_linear.route), and sibling projections
(q/k/v, gate/up) that read the same input fused into one matmul for inference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treepage.layers import cpu_linear

# Rows (tokens) up to which the fused matmul serves; longer inputs (prefills) run the separate projections, which
# read the same weights (views of the fused tensor). One call instead of three saves the thread-pool wake-up
# and the call overhead that dominate a decode step, but for hundreds of rows MKL's fp32 GEMM over the wider
# fused weight ran 2-5 % slower than the separate ones (docs/benchmarks_context.md).
FUSED_MAX_ROWS = 128


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, on the CPU bf16 kernel for few rows (decode and draft steps), and for more rows on a CPU
    without native bf16 as an fp32 matmul on widened operands (cpu_linear.py says why)."""
    route = cpu_linear.route(x, weight, bias)
    if route == "kernel":
        return cpu_linear.linear_bf16(x, weight, bias)
    if route == "widened":
        return cpu_linear.widened(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_fused(x: torch.Tensor) -> bool:
    """Whether a projection of input x [T, H] should run the fused matmul (see FUSED_MAX_ROWS)."""
    return x.shape[0] <= FUSED_MAX_ROWS


@torch.no_grad()
def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) with F.linear(x, weight, bias) == torch.cat([lin(x) for lin in linears], -1).

    One larger GEMM instead of several small ones saves a call per projection (on a CPU each call also wakes the
    thread pool); callers pick the fused or the separate path per input with use_fused and call `linear`. The
    originals' parameters become views of the fused tensors: memory stays the same, the state_dict keeps the checkpoint's
    names, and an in-place update of, say, q_proj.weight reaches the fused matmul too. The fused tensors are
    plain attributes of the caller, not parameters.
    """
    first = linears[0]
    has_bias = first.bias is not None
    assert all(lin.in_features == first.in_features for lin in linears), "fused linears must share the input"
    assert all((lin.bias is not None) == has_bias for lin in linears), (
        "all or none of the linears need a bias"
    )
    weight = torch.cat([lin.weight for lin in linears])
    bias = torch.cat([lin.bias for lin in linears]) if has_bias else None
    offset = 0
    for lin in linears:
        n = lin.out_features
        lin.weight = nn.Parameter(weight[offset : offset + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[offset : offset + n], requires_grad=False)
        offset += n
    return weight, bias
