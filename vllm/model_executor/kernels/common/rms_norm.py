"""RMSNorm in one kernel, optionally after the residual add (Triton).

In plain PyTorch a decoder's ``residual + x`` then RMSNorm is six or more
kernels of a few microseconds each; at decode sizes those launches, not the
bytes, set the time. One program normalizes one row. The roundings are
those of ``transformers``' Llama/Qwen norms: the sum rounded to the input
dtype, normalized in fp32, rounded, then scaled by the weight in the input
dtype; 16-bit outputs match the reference up to the fp32 sum order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.model_executor.kernels.common.pdl import pdl, pdl_wait


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    sum_ptr,  # x + residual (HAS_RESIDUAL)
    residual_ptr,
    x_ptr,
    weight_ptr,
    cols,
    eps,
    stride_out,
    stride_sum,
    stride_res,
    stride_x,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * stride_sum + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / cols + eps)
    normed = (x32 * rstd).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (normed * weight).to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``weight * norm(x + residual)`` over the last dim of ``x`` [R, C];
    returns it and ``x + residual`` (a new tensor; None without
    ``residual``)."""
    if (
        x.dim() != 2
        or x.stride(1) != 1
        or weight.shape != (x.shape[1],)
        or weight.stride(0) != 1
    ):
        raise ValueError(
            f"x/weight: expected [rows, C] with unit column stride and a contiguous "
            f"[C], got {tuple(x.shape)} (strides {x.stride()}) and "
            f"{tuple(weight.shape)} (strides {weight.stride()})"
        )
    if residual is not None and (
        residual.shape != x.shape
        or residual.dtype != x.dtype
        or residual.stride(1) != 1
    ):
        raise ValueError(
            f"residual: expected {x.dtype} {tuple(x.shape)} with unit column stride, "
            f"got {residual.dtype} {tuple(residual.shape)}"
        )
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(out)
    if x.shape[0]:
        launch_pdl = pdl(x.device)
        _rms_norm_kernel[(x.shape[0],)](
            out,
            total,
            residual,
            x,
            weight,
            x.shape[1],
            eps,
            out.stride(0),
            0 if total is None else total.stride(0),
            0 if residual is None else residual.stride(0),
            x.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(x.shape[1]),
            PDL=launch_pdl,
            launch_pdl=launch_pdl,
        )
    return out, total


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel's oracle and CPU path."""
    if residual is not None:
        x = residual = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), residual
