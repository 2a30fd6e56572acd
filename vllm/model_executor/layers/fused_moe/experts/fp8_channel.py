"""FP8 w8a8 experts' weights: fp8 e4m3 with one scale per output channel.

The base of the FP8 per-token backends, which differ in their pipeline
(``workspace_shapes`` and ``apply``) and may re-lay the weights out for their
kernels (then overriding ``dequantized_weights``). Their workspaces hold
per-row quantized activations laid out by :func:`fp8_rows_bytes` /
:func:`carve_fp8_rows`.
"""

from __future__ import annotations

from typing import ClassVar, Self

import torch

from vllm.model_executor.kernels.common.device_info import capability
from vllm.model_executor.kernels.common.fp8 import (
    FP8_DTYPE,
    per_channel_quant_fp8,
)
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, QuantScheme
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEExperts,
    carve,
    check_tensors,
)
from vllm.utils import align_up
from vllm.v1.worker.workspace import ALIGNMENT


def fp8_rows_bytes(rows: int, cols: int, groups: int = 1) -> int:
    """Bytes of ``rows`` fp8 rows of ``cols`` and their fp32 scales,
    ``groups`` per row."""
    return align_up(rows * cols, ALIGNMENT) + rows * groups * 4


def carve_fp8_rows(
    workspace: torch.Tensor,
    rows: int,
    cols: int,
    groups: int | None = None,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 [rows, cols] and, aligned after them, fp32 scales: [rows], or
    [rows, groups] per column group; ``offset`` bytes into a flat byte
    ``workspace``."""
    q = carve(workspace, (rows, cols), FP8_DTYPE, offset)
    shape = (rows,) if groups is None else (rows, groups)
    return q, carve(
        workspace, shape, torch.float32, offset + align_up(q.numel(), ALIGNMENT)
    )


class Fp8ChannelExperts(FusedMoEExperts):
    supported_schemes = (QuantScheme.FP8_PER_TOKEN,)

    def __init__(
        self,
        moe: FusedMoEConfig,
        w13: torch.Tensor,
        w13_scale: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
    ) -> None:
        super().__init__(moe)
        self.check_supported(moe, w13.device)
        el = moe.num_local_experts
        check_tensors(
            ("w13", w13, (el, moe.w13_rows, moe.hidden_size), FP8_DTYPE),
            ("w13_scale", w13_scale, (el, moe.w13_rows), torch.float32),
            ("w2", w2, (el, moe.hidden_size, moe.intermediate_size), FP8_DTYPE),
            ("w2_scale", w2_scale, (el, moe.hidden_size), torch.float32),
        )
        self.w13, self.w13_scale = w13.contiguous(), w13_scale.contiguous()
        self.w2, self.w2_scale = w2.contiguous(), w2_scale.contiguous()

    # Capability the backend's fp8 GEMMs need on CUDA (subclasses raise it).
    min_capability: ClassVar[tuple[int, int]] = (8, 9)

    @classmethod
    def unsupported(cls, moe: FusedMoEConfig, device: torch.device) -> str | None:
        """fp8 GEMMs need fp8 tensor cores on CUDA and sizes that are whole
        16-byte rows of fp8."""
        reason = super().unsupported(moe, device)
        if reason is not None:
            return reason
        have = capability(device)
        if have is not None and have < cls.min_capability:
            return (
                f"device: {cls.__name__} needs compute capability "
                f"{cls.min_capability} or newer, got {device} with {have}"
            )
        if moe.hidden_size % 16 or moe.intermediate_size % 16:
            return (
                "hidden_size/intermediate_size: fp8 grouped GEMMs need multiples "
                f"of 16, got {moe.hidden_size}/{moe.intermediate_size}"
            )
        return None

    @classmethod
    def from_unquantized(
        cls, moe: FusedMoEConfig, w13: torch.Tensor, w2: torch.Tensor
    ) -> Self:
        w13_q, w13_scale = per_channel_quant_fp8(w13)
        w2_q, w2_scale = per_channel_quant_fp8(w2)
        return cls(moe, w13_q, w13_scale, w2_q, w2_scale)

    def dequantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self.w13.float() * self.w13_scale[..., None],
            self.w2.float() * self.w2_scale[..., None],
        )
