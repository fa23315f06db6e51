"""fuse_linears: one matmul for sibling projections, without changing names, memory or results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from treepage.layers.linear import fuse_linears


@pytest.mark.parametrize("bias", [False, True])
def test_fused_matmul_equals_the_separate_ones(bias):
    torch.manual_seed(0)
    q, k, v = nn.Linear(32, 48, bias=bias), nn.Linear(32, 16, bias=bias), nn.Linear(32, 16, bias=bias)
    x = torch.randn(5, 32)
    expect = torch.cat([q(x), k(x), v(x)], dim=-1).detach()
    weight, fused_bias = fuse_linears(q, k, v)
    assert weight.shape == (80, 32) and (fused_bias is not None) == bias
    torch.testing.assert_close(F.linear(x, weight, fused_bias), expect, rtol=1e-6, atol=1e-6)
    # The separate modules still compute the same (their parameters are now views of the fused tensors).
    torch.testing.assert_close(torch.cat([q(x), k(x), v(x)], dim=-1), expect, rtol=0, atol=0)


def test_originals_alias_the_fused_storage_and_keep_their_names():
    torch.manual_seed(0)
    mlp = nn.ModuleDict({"gate_proj": nn.Linear(8, 12, bias=False), "up_proj": nn.Linear(8, 12, bias=False)})
    names_before = list(mlp.state_dict())
    weight, _ = fuse_linears(mlp["gate_proj"], mlp["up_proj"])
    assert list(mlp.state_dict()) == names_before  # a checkpoint loads and saves by the same names
    base = weight.untyped_storage().data_ptr()
    assert mlp["gate_proj"].weight.untyped_storage().data_ptr() == base
    assert mlp["up_proj"].weight.data_ptr() == weight[12:].data_ptr()  # no second copy of the weights
    with torch.no_grad():  # an in-place load into the original reaches the fused matmul
        mlp["up_proj"].weight.fill_(0.5)
    assert torch.equal(weight[12:], torch.full((12, 8), 0.5)) and not torch.equal(weight[:12], weight[12:])


def test_fusing_needs_a_shared_input_and_consistent_bias():
    with pytest.raises(AssertionError, match="share the input"):
        fuse_linears(nn.Linear(8, 4), nn.Linear(6, 4))
    with pytest.raises(AssertionError, match="bias"):
        fuse_linears(nn.Linear(8, 4, bias=True), nn.Linear(8, 4, bias=False))
