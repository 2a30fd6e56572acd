"""Per-head RMSNorm and rotary embedding of queries or keys in one kernel
(Triton), in place.

Qwen3 normalizes every query and key head before RoPE. In plain PyTorch
that is some twenty small kernels per layer (two norms, the cos/sin
gather, the rotations); at decode sizes their launches dominate the
attention's time. One program takes one token's heads of one tensor. It
rounds where ``transformers`` does (normed to the dtype, scaled in it; cos
and sin rounded; ``x * cos`` and ``rotate_half(x) * sin`` each rounded
before the sum); 16-bit results match the reference up to the roundings
that the fp32 sum order moves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_row(x_ptr, weight_ptr, offs, mask, eps, HEAD_DIM: tl.constexpr):
    """``weight * norm(x)`` at ``offs`` of each head row, rounded as the
    reference rounds, in fp32; ``rstd`` from the whole row."""
    x = tl.load(x_ptr, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 1) / HEAD_DIM + eps)
    normed = (x32 * rstd[:, None]).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=offs < HEAD_DIM, other=0.0)
    return (normed * weight.to(tl.float32)).to(x.dtype).to(tl.float32)


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr,  # [T, heads, HEAD_DIM], rewritten in place
    weight_ptr,  # [HEAD_DIM]
    cos_sin_ptr,  # [2, max_position, HEAD_DIM] fp32
    positions_ptr,  # [T] int64
    heads,
    eps,
    stride_t,
    stride_h,
    stride_cs,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    half = HEAD_DIM // 2
    partner = (d + half) % HEAD_DIM  # rotate_half's source column
    mask = (h < heads)[:, None]
    row = x_ptr + t * stride_t + h[:, None] * stride_h
    dtype = x_ptr.dtype.element_ty
    x = _norm_row(row + d[None, :], weight_ptr, d, mask, eps, HEAD_DIM)
    x_partner = _norm_row(
        row + partner[None, :], weight_ptr, partner, mask, eps, HEAD_DIM
    )
    rotated = tl.where(d < half, -x_partner, x_partner)
    pos = tl.load(positions_ptr + t)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + d).to(dtype).to(tl.float32)
    sin = tl.load(cos_sin_ptr + stride_cs + pos * HEAD_DIM + d).to(dtype)
    a = (x * cos[None, :]).to(dtype).to(tl.float32)
    b = (rotated * sin.to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    tl.store(row + d[None, :], (a + b).to(dtype), mask=mask)


def qk_norm_rope_(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Normalize and rotate every head of ``x`` [T, heads, head_size] in
    place (heads at unit stride) by its token's position; returns ``x``.
    ``cos_sin`` [2, max_position, head_size] fp32 holds each position's
    cos and sin."""
    tokens, heads, head_size = x.shape
    if x.stride(2) != 1 or head_size % 2 or head_size & (head_size - 1):
        raise ValueError(
            f"x: expected [T, heads, head_size] with unit stride and head_size a "
            f"power of two, got {tuple(x.shape)} (strides {x.stride()})"
        )
    if (
        cos_sin.dtype != torch.float32
        or cos_sin.shape[::2] != (2, head_size)
        or not cos_sin.is_contiguous()
    ):
        raise ValueError(
            f"cos_sin: expected contiguous fp32 [2, positions, {head_size}], got "
            f"{cos_sin.dtype} {tuple(cos_sin.shape)}"
        )
    if positions.shape != (tokens,) or weight.shape != (head_size,):
        raise ValueError(
            f"positions/weight: expected [{tokens}] and [{head_size}], got "
            f"{tuple(positions.shape)} and {tuple(weight.shape)}"
        )
    if tokens:
        _qk_norm_rope_kernel[(tokens,)](
            x,
            weight,
            cos_sin,
            positions,
            heads,
            eps,
            x.stride(0),
            x.stride(1),
            cos_sin.stride(0),
            HEAD_DIM=head_size,
            BLOCK_H=triton.next_power_of_2(heads),
        )
    return x
