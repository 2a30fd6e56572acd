"""Per-head RMSNorm and rotary embedding of queries and keys in one kernel
(Triton), in place, and optionally the step's keys and values stored into
the paged KV cache.

Qwen3 normalizes every query and key head before RoPE. In plain PyTorch
that is some twenty small kernels per layer (two norms, the cos/sin
gather, the rotations), and the cache write two more; at decode sizes
their launches dominate the attention's time. One program takes one
token's heads of one tensor (queries, keys, or values to store). Decode
batches skip this launch: paged attention applies the same device
functions (``norm_rope_heads``) to the heads it reads
(``triton_paged.DecodeKV``). It rounds where ``transformers`` does
(normed to the dtype, scaled in it; cos and sin rounded; ``x * cos``
and ``rotate_half(x) * sin`` each rounded before the sum); 16-bit
results match the reference up to the roundings that the fp32 sum order
moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.checks import check_contiguous
from vllm.model_executor.kernels.common.pdl import pdl, pdl_wait


@dataclass(frozen=True)
class QKNormRope:
    """Qwen3's per-head RMSNorm then RoPE of queries and keys: the weights,
    the norms' ``eps`` (the config gives both the same), each position's
    cos and sin [2, max_position, head_size] fp32, and the tokens' positions
    [T] int64."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    cos_sin: torch.Tensor
    positions: torch.Tensor


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
def rope_cos_sin(cos_sin_ptr, stride_sin, pos, dtype, HEAD_DIM: tl.constexpr):
    """Position ``pos``'s cos and sin [HEAD_DIM], rounded to ``dtype`` (as
    the reference rounds them) and back to fp32."""
    d = tl.arange(0, HEAD_DIM)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + d).to(dtype).to(tl.float32)
    sin = tl.load(cos_sin_ptr + stride_sin + pos * HEAD_DIM + d)
    return cos, sin.to(dtype).to(tl.float32)


@triton.jit
def norm_rope_heads(row, mask, weight_ptr, cos, sin, eps, HEAD_DIM: tl.constexpr):
    """The heads at ``row`` [BLOCK_H, 1] normed and rotated, in their dtype."""
    d = tl.arange(0, HEAD_DIM)
    half = HEAD_DIM // 2
    partner = (d + half) % HEAD_DIM  # rotate_half's source column
    dtype = row.dtype.element_ty
    x = _norm_row(row + d[None, :], weight_ptr, d, mask, eps, HEAD_DIM)
    x_partner = _norm_row(
        row + partner[None, :], weight_ptr, partner, mask, eps, HEAD_DIM
    )
    rotated = tl.where(d < half, -x_partner, x_partner)
    a = (x * cos[None, :]).to(dtype).to(tl.float32)
    b = (rotated * sin[None, :]).to(dtype).to(tl.float32)
    return (a + b).to(dtype)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,  # [T, q_heads, HEAD_DIM], rewritten in place
    k_ptr,  # [T, kv_heads, HEAD_DIM], rewritten in place
    v_ptr,  # [T, kv_heads, HEAD_DIM] (WITH_CACHE)
    q_weight_ptr,  # [HEAD_DIM]
    k_weight_ptr,  # [HEAD_DIM]
    cos_sin_ptr,  # [2, max_position, HEAD_DIM] fp32
    positions_ptr,  # [T] int64
    cache_ptr,  # [2, blocks, block_size, kv_heads, HEAD_DIM] (WITH_CACHE)
    slots_ptr,  # [T] int64 (WITH_CACHE)
    q_heads,
    kv_heads,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_cache,  # from the keys' half of the cache to the values'
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WITH_CACHE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (t, 0) takes token t's queries, (t, 1) its keys, (t, 2) its
    values (a copy into the cache: that role exists WITH_CACHE only)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    role = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    kv_mask = (h < kv_heads)[:, None]
    if WITH_CACHE:
        slot = tl.load(slots_ptr + t)
        cache_row = cache_ptr + slot * kv_heads * HEAD_DIM
        cache_row += h[:, None] * HEAD_DIM + d[None, :]
    if role == 2:
        if WITH_CACHE:  # (both branches compile: the role is a runtime value)
            v_row = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :]
            tl.store(cache_row + stride_cache, tl.load(v_row, kv_mask), kv_mask)
    else:
        pos = tl.load(positions_ptr + t)
        cos, sin = rope_cos_sin(
            cos_sin_ptr, stride_cs, pos, q_ptr.dtype.element_ty, HEAD_DIM
        )
        if role == 0:
            row = q_ptr + t * stride_qt + h[:, None] * stride_qh
            mask = (h < q_heads)[:, None]
            x = norm_rope_heads(row, mask, q_weight_ptr, cos, sin, eps, HEAD_DIM)
            tl.store(row + d[None, :], x, mask)
        else:
            row = k_ptr + t * stride_kt + h[:, None] * stride_kh
            x = norm_rope_heads(row, kv_mask, k_weight_ptr, cos, sin, eps, HEAD_DIM)
            tl.store(row + d[None, :], x, kv_mask)
            if WITH_CACHE:
                tl.store(cache_row, x, kv_mask)


def check_heads(
    name: str, x: torch.Tensor, like: torch.Tensor, heads: int | None = None
) -> None:
    """``x`` is [T, heads, head_size] as ``like`` (q) is, heads at unit
    stride, in its dtype and on its device."""
    tokens, _, head_size = like.shape
    if (
        x.dim() != 3
        or x.shape[0] != tokens
        or x.shape[2] != head_size
        or (heads is not None and x.shape[1] != heads)
        or x.stride(2) != 1
        or x.dtype != like.dtype
        or x.device != like.device
    ):
        raise ValueError(
            f"{name}: expected {like.dtype} [{tokens}, {heads or 'heads'}, "
            f"{head_size}] with unit stride on {like.device}, got {x.dtype} "
            f"{tuple(x.shape)} (strides {x.stride()}) on {x.device}"
        )


def check_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, norm_rope: QKNormRope) -> None:
    """Raise naming the argument unless ``q`` [T, heads, head_size] (a power
    of two) and ``k`` [T, kv_heads, head_size] have heads at unit stride, the
    weights are [head_size], ``cos_sin`` is contiguous fp32 [2, positions,
    head_size] and ``positions`` contiguous int64 [T]."""
    q_weight, k_weight = norm_rope.q_weight, norm_rope.k_weight
    cos_sin, positions = norm_rope.cos_sin, norm_rope.positions
    if q.dim() != 3 or q.shape[2] % 2 or q.shape[2] & (q.shape[2] - 1):
        raise ValueError(
            f"q: expected [T, heads, head_size] with head_size a power of two, "
            f"got {tuple(q.shape)}"
        )
    tokens, _, head_size = q.shape
    check_heads("q", q, q)
    check_heads("k", k, q)
    if (
        cos_sin.dtype != torch.float32
        or cos_sin.shape[::2] != (2, head_size)
        or not cos_sin.is_contiguous()
    ):
        raise ValueError(
            f"cos_sin: expected contiguous fp32 [2, positions, {head_size}], got "
            f"{cos_sin.dtype} {tuple(cos_sin.shape)}"
        )
    check_contiguous("positions", positions, torch.long, [tokens], q.device)
    if {q_weight.shape, k_weight.shape} != {(head_size,)}:
        raise ValueError(
            f"q_weight/k_weight: expected [{head_size}] each, got "
            f"{tuple(q_weight.shape)} and {tuple(k_weight.shape)}"
        )


def qk_norm_rope_(
    q: torch.Tensor,
    k: torch.Tensor,
    norm_rope: QKNormRope,
    kv_cache: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> None:
    """Normalize and rotate every head of ``q`` [T, heads, head_size] and
    ``k`` [T, kv_heads, head_size] in place (heads at unit stride) by its
    token's position, as ``norm_rope`` says. With ``kv_cache`` [2, blocks,
    block_size, kv_heads, head_size], the rotated keys and ``v`` are also
    stored at the tokens' cache slots ``slot_mapping`` [T] (as
    ``write_kv_cache``; the slots are the caller's to keep in range: they
    are not checked, which would cost a device sync)."""
    check_qk_norm_rope(q, k, norm_rope)
    positions, cos_sin = norm_rope.positions, norm_rope.cos_sin
    tokens, q_heads, head_size = q.shape
    kv_heads = k.shape[1]
    if kv_cache is None:  # the kernel reads none of these without a cache
        cache, values, slots = q, k, positions
    else:
        if v is None or slot_mapping is None:
            raise ValueError("v/slot_mapping: expected both with a kv_cache")
        check_heads("v", v, q, kv_heads)
        # [2, blocks, block_size, kv_heads, head_size]
        cache_shape = (2, *kv_cache.shape[1:3], kv_heads, head_size)
        check_contiguous("kv_cache", kv_cache, q.dtype, cache_shape, q.device)
        check_contiguous("slot_mapping", slot_mapping, torch.long, [tokens], q.device)
        cache, values, slots = kv_cache, v, slot_mapping
    if not tokens:
        return
    with_cache = kv_cache is not None
    launch_pdl = pdl(q.device)
    _qk_norm_rope_kernel[(tokens, 3 if with_cache else 2)](
        q,
        k,
        values,
        norm_rope.q_weight,
        norm_rope.k_weight,
        cos_sin,
        positions,
        cache,
        slots,
        q_heads,
        kv_heads,
        norm_rope.eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        values.stride(0),
        values.stride(1),
        cos_sin.stride(0),
        cache.stride(0),
        HEAD_DIM=head_size,
        BLOCK_H=triton.next_power_of_2(max(q_heads, kv_heads)),
        WITH_CACHE=with_cache,
        PDL=launch_pdl,
        launch_pdl=launch_pdl,
    )
