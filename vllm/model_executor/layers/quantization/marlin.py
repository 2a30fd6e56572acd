"""A dense linear layer with Marlin-style W4A16 weights."""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.kernels.marlin import TILE_K
from vllm.model_executor.layers.quantization.utils.marlin_utils import (
    apply_marlin_linear,
    marlin_quantize_and_repack,
)


class MarlinLinear(nn.Module):
    """``y = x @ W^T`` with W stored as uint4 + per-group scales.

    Load full-precision weights with :meth:`weight_loader`, then call
    :meth:`process_weights_after_loading`, which quantizes and repacks them.
    The layer owns only its weights: the split-K lock workspace is looked up
    at execution time by the runtime op, so reloading weights after the
    workspace manager is locked needs no new workspace.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group_size: int = 128,
        params_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if params_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"params_dtype: expected bf16 or fp16, got {params_dtype}")
        # The kernel steps K by TILE_K; scale groups must hold whole steps.
        if in_features % TILE_K != 0:
            raise ValueError(
                f"in_features: expected a multiple of {TILE_K}, got {in_features}"
            )
        if group_size != -1 and (group_size % TILE_K or in_features % group_size):
            raise ValueError(
                f"group_size: expected -1 or a multiple of {TILE_K} dividing "
                f"in_features={in_features}, got {group_size}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.params_dtype = params_dtype
        self.weight: nn.Parameter | None = nn.Parameter(
            torch.empty(out_features, in_features, dtype=params_dtype, device=device),
            requires_grad=False,
        )
        self.qweight: torch.Tensor | None
        self.scales: torch.Tensor | None
        self.register_buffer("qweight", None)
        self.register_buffer("scales", None)

    def weight_loader(self, loaded_weight: torch.Tensor) -> None:
        """Load full-precision weights [out_features, in_features] (also to reload)."""
        expected = (self.out_features, self.in_features)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"loaded_weight: expected shape {expected}, got "
                f"{tuple(loaded_weight.shape)}"
            )
        if self.weight is None:  # reload after processing
            device = self.qweight.device if self.qweight is not None else None
            self.weight = nn.Parameter(
                torch.empty(expected, dtype=self.params_dtype, device=device),
                requires_grad=False,
            )
        self.weight.data.copy_(loaded_weight)

    def process_weights_after_loading(self) -> None:
        """Quantize and repack; keeps no workspace, only weights and scales."""
        if self.weight is None:
            raise RuntimeError("no weights loaded: call weight_loader() first")
        qweight, scales = marlin_quantize_and_repack(
            self.weight.data, self.group_size, self.params_dtype
        )
        if (
            self.qweight is not None
            and self.scales is not None
            and self.qweight.shape == qweight.shape
            and self.scales.shape == scales.shape
        ):
            # Reload: keep the storage that captured CUDA graphs point at.
            self.qweight.copy_(qweight)
            self.scales.copy_(scales)
        else:
            self.qweight, self.scales = qweight, scales
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is None or self.scales is None:
            raise RuntimeError("call process_weights_after_loading() before forward")
        if x.shape[-1] != self.in_features or x.dtype != self.params_dtype:
            raise ValueError(
                f"x: expected [..., {self.in_features}] {self.params_dtype}, got "
                f"{tuple(x.shape)} {x.dtype}"
            )
        return apply_marlin_linear(
            x,
            self.qweight,
            self.scales,
            self.group_size,
            self.out_features,
            self.in_features,
        )
