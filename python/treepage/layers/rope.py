"""Rotary position embedding (rotate-half convention), with Llama-3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from treepage.layers import cpu_rope


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(mid, scaled, inv_freq)
    elif rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)")
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Tables are full head width, sin with the rotate-half sign folded in (first half negated), so a rotation is
    x * cos + swap_halves(x) * sin: no per-layer concatenation of the tables and no negation of x. The rows of one
    forward's positions are gathered once and reused by every layer (the model calls this once per layer with the
    same positions tensor). On the CPU the kernel of cpu_rope.py rotates q and k with the same values in one pass
    each."""

    cos: torch.Tensor  # [max_position, D] buffers: [cos, cos] and [-sin, sin]
    sin: torch.Tensor

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1), persistent=False)
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (positions, cos, sin)
        # (positions, the same as the kernel reads them, or None where it cannot)
        self._kernel_positions: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows [T, 1, D] of these positions; gathered once per positions tensor (held, so its id is not
        reused while it is cached)."""
        rows = self._rows
        if rows is None or rows[0] is not positions or rows[1].device != positions.device:
            rows = (positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
            self._rows = rows
        return rows[1], rows[2]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D]; rotates in fp32, returns the input dtype."""
        pos = self.kernel_positions(positions) if cpu_rope.serves(q) and cpu_rope.serves(k) else None
        if pos is not None and pos.numel() == q.shape[0] == k.shape[0]:
            return cpu_rope.rotate(q, pos, self.cos, self.sin), cpu_rope.rotate(k, pos, self.cos, self.sin)
        cos, sin = self.tables(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def kernel_positions(self, positions: torch.Tensor) -> torch.Tensor | None:
        """positions as the kernel reads them (int64, contiguous), or None where one is out of the tables' range
        (the torch path then raises); checked once per positions tensor, like `tables`."""
        cached = self._kernel_positions
        if cached is None or cached[0] is not positions:
            n = self.cos.shape[0]
            ok = positions.numel() == 0 or (int(positions.min()) >= 0 and int(positions.max()) < n)
            on_cpu = positions.device.type == self.cos.device.type == "cpu"
            pos = positions.reshape(-1).to(torch.int64).contiguous() if ok and on_cpu else None
            cached = (positions, pos)
            self._kernel_positions = cached
        return cached[1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([x2, x1], dim=-1) * sin).to(x.dtype)
