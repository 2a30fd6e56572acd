"""The models' unquantized dense layers."""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.kernels.common.device_info import runs_gpu_kernels
from vllm.model_executor.kernels.common.skinny_gemm import (
    SKINNY_MAX_ROWS,
    skinny_gemm,
)


class UnquantizedLinear(nn.Linear):
    """A bias-free ``nn.Linear`` (frozen weight) whose decode-size calls, up
    to ``SKINNY_MAX_ROWS`` rows of 16-bit activations on a GPU, stream the
    weight with ``skinny_gemm``; other calls are ``nn.Linear``'s."""

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
        if (
            runs_gpu_kernels(x)
            and 0 < rows <= SKINNY_MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(-1) == 1
        ):
            out = skinny_gemm(x.reshape(rows, self.in_features), self.weight)
            return out.view(*x.shape[:-1], self.out_features)
        return super().forward(x)
