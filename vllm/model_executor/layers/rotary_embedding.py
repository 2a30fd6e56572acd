"""Rotary position embedding (the "rotate half" form of Llama/Qwen models)."""

from __future__ import annotations

import functools

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


@functools.cache  # one table for all layers (48 copies would be ~2 GiB)
def _cos_sin_table(
    head_size: int, rope_theta: float, max_position: int, device: torch.device
) -> torch.Tensor:
    exponents = (
        torch.arange(0, head_size, 2, dtype=torch.float, device=device) / head_size
    )
    positions = torch.arange(max_position, dtype=torch.float, device=device)
    freqs = positions[:, None] * (1.0 / rope_theta**exponents)
    angles = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((angles.cos(), angles.sin()))


class RotaryEmbedding(nn.Module):
    """Rotates each head's ``head_size`` dims of ``q`` and ``k`` by the token's
    position: frequencies ``theta ** (-2i / head_size)`` in fp32, cos and sin
    rounded to the activations' dtype (as ``transformers`` computes them).
    The angles of every position up to ``max_position`` are computed once on
    ``device``, one table for all layers: a step gathers its rows (one
    kernel, and no host tensor that a CUDA graph capture could not copy)."""

    def __init__(
        self,
        head_size: int,
        rope_theta: float,
        max_position: int,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if head_size % 2:
            raise ValueError(f"head_size: expected an even number, got {head_size}")
        self.cos_sin: torch.Tensor
        self.register_buffer(
            "cos_sin",
            _cos_sin_table(head_size, rope_theta, max_position, torch.device(device)),
            persistent=False,
        )

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` [T, heads, head_size], ``k`` [T, kv_heads, head_size] at
        ``positions`` [T] (< ``max_position``); returns both rotated."""
        cos, sin = self.cos_sin[:, positions, None, :].to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
