"""RMSNorm as Hugging Face models compute it (a Triton kernel on CUDA, plain
PyTorch on CPU)."""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.kernels.common.device_info import runs_gpu_kernels
from vllm.model_executor.kernels.common.rms_norm import rms_norm, rms_norm_reference


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))``: normalized in fp32, rounded to ``x``'s dtype,
    then scaled (in that order, as ``transformers``' Llama/Qwen norms do; the
    CUDA kernel's fp32 sum order may move a 16-bit rounding by an ulp)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self._norm(x, None)
        return out

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: a decoder layer's residual
        add and the next norm in one kernel on CUDA."""
        out, total = self._norm(x, residual)
        assert total is not None
        return out, total

    def _norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if runs_gpu_kernels(x) and x.dim() == 2:
            return rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_reference(x, self.weight, self.eps, residual)
