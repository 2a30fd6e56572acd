"""Plain-PyTorch references of the grouped GEMMs in :mod:`.api`: the oracle
in tests and the expert layers' CPU path.

Same arguments and checks as the kernels; each expert's rows are computed
in fp32 from the dequantized operands (fp8: ``a`` times its row or group
scales, then the product times the channel scales) and rounded once into
``out``. Rows at or past ``offsets[E]`` are not written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from vllm.model_executor.kernels.common.activation_quant import gated_act_reference
from vllm.model_executor.kernels.common.fp8 import per_token_group_quant_fp8
from vllm.model_executor.kernels.grouped_gemm.api import check_gated, check_plain
from vllm.model_executor.kernels.grouped_gemm.hopper_common import GROUP
from vllm.model_executor.kernels.grouped_gemm.layout import (
    act_groups,
    deinterleave_gate_up,
)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of fp8 rows ``q`` [R, C] with per-row scales [R] or
    per-group scales [R, act_groups(C)]."""
    if scale.dim() == 1:
        return q.float() * scale[:, None]
    return q.float() * scale.repeat_interleave(GROUP.value, 1)[:, : q.shape[1]]


def quantize_groups_reference(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 rows of ``y`` [R, C] with one scale per row and group of 128
    columns (the gated GEMM's fp8 output; a partial last group is padded
    with zeros)."""
    cols, group = y.shape[1], GROUP.value
    padded = torch.nn.functional.pad(y, (0, act_groups(cols) * group - cols))
    q, scale = per_token_group_quant_fp8(padded, group)
    return q[:, :cols].contiguous(), scale


def expert_products(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    num_experts: int,
    expert_weight: Callable[[int], torch.Tensor],
    offsets: torch.Tensor,
    tokens: torch.Tensor | None = None,
) -> Iterator[tuple[int, slice, torch.Tensor]]:
    """For each expert ``e`` with rows: ``e``, the rows' slice and their fp32
    product with ``expert_weight(e)^T`` (fp32 [N, K], dequantized as the
    caller's format needs). Row ``r`` reads ``a[r]``, or ``a[tokens[r]]``
    where the GEMM gathers its rows."""
    bounds = offsets.tolist()
    for e in range(num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if lo < hi:
            rows = slice(lo, hi)
            src = rows if tokens is None else tokens[rows]
            x = (
                a[src].float()
                if a_scale is None
                else dequantize_rows(a[src], a_scale[src])
            )
            yield e, rows, x @ expert_weight(e).t()


def _expert_products(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    offsets: torch.Tensor,
    tokens: torch.Tensor | None = None,
) -> Iterator[tuple[slice, torch.Tensor]]:
    """:func:`expert_products` of 16-bit or fp8 weights ``w`` [E, N, K],
    times the channel scales ``w_scale`` [E, N] where given."""

    def weight(e: int) -> torch.Tensor:
        return w[e].float()

    for e, rows, product in expert_products(
        a, a_scale, w.shape[0], weight, offsets, tokens
    ):
        yield rows, product if w_scale is None else product * w_scale[e]


def grouped_gemm_reference(
    a: torch.Tensor,
    w: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
    *,
    a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~.api.grouped_gemm` in plain PyTorch."""
    check_plain(a, w, expert_first_token_offset, out, a_scale, w_scale)
    products = _expert_products(a, a_scale, w, w_scale, expert_first_token_offset)
    for rows, product in products:
        out[rows] = product.to(out.dtype)
    return out


def grouped_gemm_gated_reference(
    a: torch.Tensor,
    src_routes: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    activation: str,
    out: torch.Tensor,
    *,
    a_scale: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~.api.grouped_gemm_gated` in plain PyTorch (an fp8 ``out`` as
    :func:`quantize_groups_reference` quantizes)."""
    check_gated(
        a,
        src_routes,
        topk,
        w13,
        expert_first_token_offset,
        activation,
        out,
        a_scale,
        w13_scale,
        out_scale,
    )
    tokens = src_routes.long() // topk
    products = _expert_products(
        a, a_scale, w13, w13_scale, expert_first_token_offset, tokens
    )
    for rows, product in products:
        y = gated_act_reference(activation, deinterleave_gate_up(product))
        if out_scale is None:
            out[rows] = y.to(out.dtype)
        else:
            out[rows], out_scale[rows] = quantize_groups_reference(y)
    return out


def grouped_gemm_fp8_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`~.api.grouped_gemm_fp8` in plain PyTorch."""
    return grouped_gemm_reference(
        a, w, expert_first_token_offset, out, a_scale=a_scale, w_scale=w_scale
    )


def grouped_gemm_fp8_gated_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    src_routes: torch.Tensor,
    topk: int,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    activation: str,
    out: torch.Tensor,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~.api.grouped_gemm_fp8_gated` in plain PyTorch."""
    return grouped_gemm_gated_reference(
        a,
        src_routes,
        topk,
        w13,
        expert_first_token_offset,
        activation,
        out,
        a_scale=a_scale,
        w13_scale=w13_scale,
        out_scale=out_scale,
    )
