"""Configuration of a fused MoE layer and of its quantization."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

import torch

from vllm.model_executor.kernels.common.activation_quant import ACTIVATIONS
from vllm.model_executor.layers.fused_moe.expert_placement import ExpertPlacement


class QuantScheme(enum.Enum):
    UNQUANTIZED = "unquantized"
    FP8_PER_TOKEN = "fp8_w8a8_per_token"  # fp8 weights per channel, acts per token
    FP8_BLOCK = "fp8_w8a8_block"  # 128x128 weight blocks, 1x128 activation groups
    W4A16_UINT4 = "w4a16_uint4"  # uint4 weights, bf16 scales per group of 128
    W4A16_MXFP4 = "w4a16_mxfp4"  # fp4 e2m1 weights, e8m0 scales per group of 32
    W4A8_UINT4 = "w4a8_uint4"  # uint4 weights, fp32 scales per group of 128, fp8 acts


@dataclass(frozen=True)
class FusedMoEQuantConfig:
    scheme: QuantScheme = QuantScheme.UNQUANTIZED

    @property
    def prequantized(self) -> bool:
        """Activations are quantized before dispatch (block FP8 models)."""
        return self.scheme is QuantScheme.FP8_BLOCK

    @property
    def block_size(self) -> int:
        """Activation group / weight block edge for block FP8."""
        return 128


@dataclass(frozen=True)
class FusedMoEConfig:
    """Shape of one MoE layer on one expert-parallel rank."""

    num_experts: int
    experts_per_token: int
    hidden_size: int
    intermediate_size: int  # per expert; w13 has 2 x this many rows
    in_dtype: torch.dtype = torch.bfloat16
    activation: str = "silu"
    ep_rank: int = 0
    ep_size: int = 1
    quant_config: FusedMoEQuantConfig = field(default_factory=FusedMoEQuantConfig)

    def __post_init__(self) -> None:
        def bad(name: str, expected: str, got: object) -> ValueError:
            return ValueError(f"{name}: expected {expected}, got {got}")

        if self.num_experts < 1:
            raise bad("num_experts", ">= 1", self.num_experts)
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise bad(
                "experts_per_token",
                f"1..num_experts={self.num_experts}",
                self.experts_per_token,
            )
        if self.hidden_size < 1 or self.intermediate_size < 1:
            raise bad(
                "hidden_size/intermediate_size",
                ">= 1",
                (self.hidden_size, self.intermediate_size),
            )
        if self.in_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise bad(
                "in_dtype",
                "torch.bfloat16, torch.float16 or torch.float32",
                self.in_dtype,
            )
        if self.activation not in ACTIVATIONS:
            raise bad("activation", f"one of {ACTIVATIONS}", self.activation)
        _ = self.placement  # checks ep_size and ep_rank

    @functools.cached_property  # num_local_experts is read on every forward
    def placement(self) -> ExpertPlacement:
        """This rank's experts under linear placement."""
        return ExpertPlacement(self.num_experts, self.ep_size, self.ep_rank)

    @property
    def num_local_experts(self) -> int:
        return self.placement.num_local_experts

    @property
    def w13_rows(self) -> int:
        return 2 * self.intermediate_size

    def make_expert_map(self, device: torch.device | str) -> torch.Tensor | None:
        """Global id -> local id on this rank, -1 elsewhere (None without EP)."""
        return self.placement.expert_map(device)
