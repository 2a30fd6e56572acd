"""Causal self-attention of one sequence, in plain PyTorch.

The model's attention for a prefill of one sequence (all ``T`` tokens attend
to those before them), with grouped-query heads. It is the CPU path and the
oracle; the paged KV cache and its GPU backends come with the engine and take
the same ``forward(q, k, v)``.
"""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, head_size: int, scale: float, num_kv_heads: int
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads: expected a divisor of num_heads={num_heads}, got "
                f"{num_kv_heads}"
            )
        self.num_heads, self.head_size = num_heads, head_size
        self.num_kv_heads, self.scale = num_kv_heads, scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q`` [T, heads, head_size], ``k``/``v`` [T, kv_heads, head_size]
        -> [T, heads * head_size]. Scores in the activations' dtype, softmax
        in fp32 (as ``transformers``' eager attention)."""
        tokens = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
        future = torch.ones(tokens, tokens, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.einsum("hqk,khd->qhd", probs, v)
        return out.reshape(tokens, self.num_heads * self.head_size)
