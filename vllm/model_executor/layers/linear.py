"""The models' unquantized dense layers."""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.kernels.common.checks import check_norm_operands
from vllm.model_executor.kernels.common.device_info import runs_gpu_kernels
from vllm.model_executor.kernels.common.pdl import pdl
from vllm.model_executor.kernels.common.skinny_gemm import (
    rms_norm_skinny_gemm,
    skinny_gemm,
    skinny_gemm_applies,
)
from vllm.model_executor.layers.layernorm import RMSNorm


class UnquantizedLinear(nn.Linear):
    """A bias-free ``nn.Linear`` (frozen weight); on a GPU the products that
    ``skinny_gemm`` wins (a token or two through a short weight: a MoE
    router or an output projection at decode; at one token where kernels
    launch with PDL, any weight of K <= 4096, as q/k/v and the head) run
    there, the others are ``nn.Linear``'s."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(
            in_features, out_features, bias=False, dtype=dtype, device=device
        )
        self.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self._skinny(x, rows):
            out = skinny_gemm(x.reshape(rows, self.in_features), self.weight)
            return out.view(*x.shape[:-1], self.out_features)
        return super().forward(x)

    def _skinny(self, x: torch.Tensor, rows: int) -> bool:
        return (
            runs_gpu_kernels(x)
            and skinny_gemm_applies(
                rows, self.out_features, self.in_features, x.dtype, pdl(x.device)
            )
            and x.stride(-1) == 1
        )


def rms_norm_linear(
    norm: RMSNorm,
    linear: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(norm(x + residual)), x + residual)`` for [tokens, hidden]
    rows (without ``residual``: of ``x``, and ``x``): a decoder layer's
    residual add, norm and first GEMM. One kernel where ``skinny_gemm``
    takes the product (``rms_norm_skinny_gemm``: q/k/v at one token), else
    the norm's kernel, then the linear."""
    check_norm_operands(x, residual, norm.weight)
    if isinstance(linear, UnquantizedLinear) and linear._skinny(x, x.shape[0]):
        return rms_norm_skinny_gemm(x, residual, norm.weight, norm.eps, linear.weight)
    if residual is None:
        return linear(norm(x)), x
    normed, total = norm.add_and_norm(x, residual)
    return linear(normed), total
