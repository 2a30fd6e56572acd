"""FP8 (e4m3) constants and quantization of activations and weights in plain
PyTorch (the CPU path, and the oracle of the fused kernels)."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
MIN_SCALE = 1e-12  # keeps all-zero rows finite (scale = MIN_SCALE / FP8_MAX)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row quantization: (q [M, K] fp8, scale [M, 1] fp32)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(MIN_SCALE) / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic quantization per row and group of ``group_size`` columns.

    Returns (q [M, K] fp8, scale [M, K // group_size] fp32).
    """
    m, k = x.shape
    if k % group_size:
        raise ValueError(
            f"x: hidden size {k} is not a multiple of the group size {group_size}"
        )
    groups = x.float().view(m, k // group_size, group_size)
    scale = groups.abs().amax(dim=-1).clamp_min(MIN_SCALE) / FP8_MAX
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, k), scale


def per_channel_quant_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [..., N, K] -> (q fp8, scale [..., N] fp32), one scale per row."""
    q, scale = per_token_quant_fp8(w.reshape(-1, w.shape[-1]))
    return q.view(w.shape), scale.view(w.shape[:-1])
