"""The CPU rotary kernel (layers/cpu_rope.c): bit for bit the torch path's values in fp32 and bf16, on strided
views, on one thread and on the pool; RotaryEmbedding runs it where it serves and the torch path elsewhere."""

from __future__ import annotations

import pytest
import torch

from treepage.layers import cpu_rope
from treepage.layers.rope import RotaryEmbedding, _rotate

pytestmark = pytest.mark.skipif(cpu_rope.load() is None, reason="needs a C compiler")  # CI has one

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def torch_path(rope: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _rotate(x, rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "T, H, D", [(1, 3, 64), (7, 9, 64), (5, 2, 128), (300, 12, 64)]
)  # the last on the pool
@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_kernel_equals_the_torch_path_bit_for_bit(dtype, T, H, D, scaling):
    g = torch.Generator().manual_seed(T * 100 + H)
    rope = RotaryEmbedding(D, 4096, 10000.0, scaling)
    positions = torch.randint(0, 4096, (T,), generator=g)
    positions[0] = 4095
    x = (torch.randn(T, H, D, generator=g) * 4).to(dtype)
    got = cpu_rope.rotate(x, positions, rope.cos, rope.sin)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, torch_path(rope, positions, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_views_of_a_fused_projection(dtype):
    """q and k as the fused q/k/v matmul leaves them: views into one [T, (Hq + 2 Hk) D] tensor."""
    T, Hq, Hk, D = 6, 9, 3, 64
    rope = RotaryEmbedding(D, 512, 100000.0, None)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D).to(dtype)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k = q.view(T, Hq, D), k.view(T, Hk, D)
    assert not q.is_contiguous() and cpu_rope.serves(q) and cpu_rope.serves(k)
    positions = torch.arange(100, 100 + T)
    before = qkv.clone()
    rq, rk = rope(positions, q, k)
    assert torch.equal(rq, torch_path(rope, positions, q.contiguous()))
    assert torch.equal(rk, torch_path(rope, positions, k.contiguous()))
    assert torch.equal(qkv, before)  # the inputs are left as they were


def test_rotary_embedding_runs_the_kernel_where_it_serves(monkeypatch):
    calls: list[torch.dtype] = []
    real = cpu_rope.rotate

    def counted(x, *args):
        calls.append(x.dtype)
        return real(x, *args)

    monkeypatch.setattr(cpu_rope, "rotate", counted)
    rope = RotaryEmbedding(64, 256, 10000.0, None)
    positions = torch.arange(4)
    q, k = torch.randn(4, 9, 64), torch.randn(4, 3, 64)
    rope(positions, q.bfloat16(), k.bfloat16())
    assert calls == [torch.bfloat16, torch.bfloat16]
    # autograd (head training) and other dtypes stay on the torch path, with the same values
    calls.clear()
    qg = q.clone().requires_grad_()
    rq, rk = rope(positions, qg, k)
    assert calls == [] and rq.requires_grad
    rq.sum().backward()
    assert qg.grad is not None
    with torch.no_grad():
        assert torch.equal(rope(positions, q, k)[0], rq.detach())
    rope(positions, q.half(), k.half())
    assert calls == [torch.float32, torch.float32]  # the no-grad fp32 call above; fp16 did not run it


def test_out_of_range_positions_still_raise():
    rope = RotaryEmbedding(64, 16, 10000.0, None)
    q, k = torch.randn(2, 3, 64), torch.randn(2, 1, 64)
    with pytest.raises(IndexError):
        rope(torch.tensor([3, 16]), q, k)
    with pytest.raises(IndexError):
        rope(torch.tensor([-20, 1]), q, k)
