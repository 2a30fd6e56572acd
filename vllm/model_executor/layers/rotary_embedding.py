"""Rotary position embedding (the "rotate half" form of Llama/Qwen models)."""

from __future__ import annotations

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates each head's ``head_size`` dims of ``q`` and ``k`` by the token's
    position: frequencies ``theta ** (-2i / head_size)`` in fp32, cos and sin
    rounded to the activations' dtype (as ``transformers`` computes them)."""

    def __init__(self, head_size: int, rope_theta: float) -> None:
        super().__init__()
        if head_size % 2:
            raise ValueError(f"head_size: expected an even number, got {head_size}")
        exponents = torch.arange(0, head_size, 2, dtype=torch.float) / head_size
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / rope_theta**exponents, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` [T, heads, head_size], ``k`` [T, kv_heads, head_size] at
        ``positions`` [T]; returns both rotated."""
        freqs = positions[:, None].float() * self.inv_freq.to(q.device)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
