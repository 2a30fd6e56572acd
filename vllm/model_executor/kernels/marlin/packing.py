"""Offline weight packing of the Marlin-style W4A16 GEMM, and its inverse.

Weights are quantized symmetrically to uint4 ``q`` in 0..15 with
``dequant = (q - 8) * scale``; scales are per group of ``group_size`` along K
(``[K // group_size, N]``) or per output channel (``group_size == -1``,
``[1, N]``). :func:`repack_weights` stores ``q[N, K]`` as ``packed[N, K // 8]``
int32, K contiguous: word ``c`` of row ``n`` holds ``k = 8c .. 8c + 7``, nibble
``i < 4`` holds ``k = 8c + 2i`` and nibble ``i + 4`` holds ``k = 8c + 2i + 1``
(the order the kernel dequantizes (k, k + 1) pairs in, see :mod:`.kernels`).
:func:`dequantize_weights` is the plain-PyTorch reference of what the kernel
multiplies by: the CPU path and the test oracle.
"""

import torch

from vllm.model_executor.kernels.marlin.config import PACK


def quantize_weights(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric uint4 (bias 8) quantization of ``w[N, K]``.

    Returns ``q[N, K]`` uint8 in 0..15 and float32 ``scales[K // group_size, N]``
    (``[1, N]`` for ``group_size == -1``); cast the scales to the activation
    dtype before use.
    """
    n, k = w.shape
    g = k if group_size == -1 else group_size
    if k % g != 0:
        raise ValueError(f"group_size: {group_size} does not divide K={k}")
    wg = w.float().reshape(n, k // g, g)
    scales = wg.abs().amax(dim=-1).clamp_min(1e-8) / 7.0  # [N, groups]
    q = torch.clamp(torch.round(wg / scales[..., None]) + 8, 0, 15)
    return q.reshape(n, k).to(torch.uint8), scales.t().contiguous()


def repack_weights(q: torch.Tensor) -> torch.Tensor:
    """``q[N, K]`` (0..15) -> ``packed[N, K // 8]`` int32 in the kernel's layout."""
    n, k = q.shape
    if k % PACK != 0:
        raise ValueError(f"q: K={k} must be a multiple of {PACK}")
    # Per word: (k0, k1, ..., k7) -> nibbles (k0, k2, k4, k6, k1, k3, k5, k7).
    words = q.to(torch.int64).reshape(n, k // PACK, 4, 2).transpose(-1, -2)
    words = words.reshape(n, k // PACK, PACK)
    shifts = torch.arange(PACK, device=q.device, dtype=torch.int64) * 4
    packed = (words << shifts).sum(dim=-1)
    # Two's-complement wrap into int32.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_weights(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`repack_weights`: ``[N, K // 8]`` int32 -> ``q[N, K]``."""
    n, kw = packed.shape
    shifts = torch.arange(PACK, device=packed.device, dtype=torch.int32) * 4
    nib = (packed[..., None] >> shifts) & 0xF  # [N, K//8, 8] in nibble order
    return nib.reshape(n, kw, 2, 4).transpose(-1, -2).reshape(n, kw * PACK)


def dequantize_weights(
    q_or_packed: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Reference ``(q - 8) * scale`` as ``[N, K]`` in ``scales``' dtype.

    Takes ``q[N, K]`` (uint8) or ``packed[N, K // 8]`` (int32).
    """
    q = unpack_weights(q_or_packed) if q_or_packed.dtype == torch.int32 else q_or_packed
    k = q.shape[1]
    g = k if group_size == -1 else group_size
    s = scales.t().float().repeat_interleave(g, dim=1)  # [N, K]
    return ((q.float() - 8.0) * s).to(scales.dtype)
