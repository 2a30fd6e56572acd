"""Gated activations between the two expert GEMMs.

CUDA tensors run one fused Triton pass (activation, and for fp8 the per-row
quantization); CPU tensors run the plain-PyTorch reference.
"""

from __future__ import annotations

import torch

from vllm.model_executor.kernels.common.activation_quant import (
    act_and_quant,
    gated_act_reference,
)
from vllm.model_executor.kernels.common.device_info import runs_gpu_kernels
from vllm.model_executor.kernels.common.fp8 import (
    per_token_quant_fp8,
)


def apply_moe_activation(
    activation: str, out: torch.Tensor, gate_up: torch.Tensor
) -> torch.Tensor:
    """``out[R, I] = act(gate_up[:, :I], gate_up[:, I:])`` (see ``ACTIVATIONS``)."""
    if runs_gpu_kernels(gate_up):
        act_and_quant(gate_up, out, activation)
        return out
    return out.copy_(gated_act_reference(activation, gate_up))


def quant_rows_fp8(
    x: torch.Tensor,
    out: torch.Tensor,
    out_scale: torch.Tensor,
    activation: str | None = None,
) -> None:
    """``out, out_scale`` = per-row fp8 quantization of ``act(x)`` (or ``x``)."""
    if runs_gpu_kernels(x):
        act_and_quant(x, out, activation, out_scale)
        return
    rows = x if activation is None else gated_act_reference(activation, x)
    q, scale = per_token_quant_fp8(rows)
    out.copy_(q)
    out_scale.copy_(scale.view(-1))
