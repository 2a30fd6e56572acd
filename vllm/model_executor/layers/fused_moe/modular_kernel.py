"""The modular MoE kernel: prepare -> experts.apply -> finalize.

``FusedMoEPrepareAndFinalize`` moves activations to the experts (here: a
single process, optionally quantizing them first) and back. ``FusedMoEExperts``
computes the experts on the routed tokens. The modular kernel takes both of
the experts' workspaces from the workspace manager in one
``get_simultaneous`` call, so every MoE layer of a slot shares them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Self

import torch

from vllm.model_executor.kernels.common.fp8 import (
    per_token_group_quant_fp8,
)
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
    QuantScheme,
)
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    MoEPermuteScratch,
    get_moe_permute_scratch,
)
from vllm.v1.worker.workspace import get_workspace_buffers

Shape = tuple[int, ...]


def carve(
    workspace: torch.Tensor, shape: Shape, dtype: torch.dtype, offset: int = 0
) -> torch.Tensor:
    """A ``shape``/``dtype`` view of a flat byte workspace, ``offset`` bytes in."""
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    if offset % dtype.itemsize or offset + nbytes > workspace.numel():
        raise ValueError(
            f"workspace: {workspace.numel()} bytes cannot hold {shape} {dtype} at "
            f"byte offset {offset}"
        )
    return workspace[offset : offset + nbytes].view(dtype).view(shape)


def check_tensors(
    *specs: tuple[str, torch.Tensor, Shape, torch.dtype | None],
) -> None:
    """Raise naming the first tensor whose shape or dtype is off (a dtype of
    None accepts any floating-point tensor)."""
    for name, t, shape, dtype in specs:
        ok_dtype = t.is_floating_point() if dtype is None else t.dtype == dtype
        if tuple(t.shape) != shape or not ok_dtype:
            expected = "a floating-point" if dtype is None else str(dtype)
            raise ValueError(
                f"{name}: expected {expected} {shape}, got {tuple(t.shape)} {t.dtype}"
            )


class FusedMoEPrepareAndFinalize(ABC):
    """Moves activations to the experts and the experts' output back."""

    @abstractmethod
    def prepare(
        self, a1: torch.Tensor, quant_config: FusedMoEQuantConfig
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the activations the experts read and their scales (or None)."""

    @abstractmethod
    def finalize(self, fused_out: torch.Tensor) -> torch.Tensor:
        """Returns the layer output from the experts' reduced output."""


class MoEPrepareAndFinalizeNoEP(FusedMoEPrepareAndFinalize):
    """Single process: no dispatch or combine.

    With a prequantized scheme (block FP8) the activations are quantized here,
    before dispatch, in groups of 128 along the hidden dimension.
    """

    def prepare(
        self, a1: torch.Tensor, quant_config: FusedMoEQuantConfig
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if quant_config.prequantized:
            return per_token_group_quant_fp8(a1, quant_config.block_size)
        return a1, None

    def finalize(self, fused_out: torch.Tensor) -> torch.Tensor:
        return fused_out


class FusedMoEExperts(ABC):
    """Experts of one MoE layer, holding that layer's prepared weights only.

    Scratch and lock buffers come from the workspace manager at execution
    time (inside :meth:`apply`), never from the object, so an experts object
    can be rebuilt (weight reload) after the manager is locked.
    """

    supported_schemes: ClassVar[tuple[QuantScheme, ...]]
    # Activation dtypes; float32 layers (CPU parity checks) take grouped_mm.
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.bfloat16,
        torch.float16,
    )

    def __init__(self, moe: FusedMoEConfig) -> None:
        self.moe = moe

    @classmethod
    def unsupported(cls, moe: FusedMoEConfig, device: torch.device) -> str | None:
        """Why this backend cannot run ``moe`` with weights on ``device`` (a
        message naming the argument and what was expected), or None.

        The backend-choice protocol: ``make_experts`` asks every backend in
        order and takes the first that answers None. The base checks the
        quantization scheme; backends add their own limits after it.
        """
        if moe.quant_config.scheme not in cls.supported_schemes:
            return (
                f"moe.quant_config.scheme: {cls.__name__} runs "
                f"{[s.value for s in cls.supported_schemes]}, got "
                f"{moe.quant_config.scheme.value}"
            )
        if moe.in_dtype not in cls.supported_dtypes:
            return (
                f"moe.in_dtype: {cls.__name__} takes {list(cls.supported_dtypes)}, "
                f"got {moe.in_dtype}"
            )
        return None

    @classmethod
    def check_supported(cls, moe: FusedMoEConfig, device: torch.device) -> None:
        """Raise ``ValueError`` with :meth:`unsupported`'s reason, if any;
        every way to build experts from weights (the constructor, or
        :meth:`from_unquantized` where the constructor takes prepared kernel
        objects) calls it, so no backend runs what it refuses."""
        reason = cls.unsupported(moe, device)
        if reason is not None:
            raise ValueError(reason)

    @classmethod
    @abstractmethod
    def from_unquantized(
        cls, moe: FusedMoEConfig, w13: torch.Tensor, w2: torch.Tensor
    ) -> Self:
        """Prepare (quantize, re-lay out) full-precision weights w13
        [E_local, 2I, K] (gate rows first) and w2 [E_local, K, I]."""

    @abstractmethod
    def workspace_shapes(
        self,
        M: int,
        N: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
    ) -> tuple[Shape, Shape, Shape]:
        """(workspace13, workspace2, output) shapes in ``workspace_dtype``
        elements (output in the activation dtype) for M tokens, w13 with N
        rows and hidden size K."""

    def permute_scratch(self, device: torch.device) -> MoEPermuteScratch:
        """The running slot's shared permute scratch; call it inside
        :meth:`apply`, never keep it (another slot may run next)."""
        return get_moe_permute_scratch(
            num_experts=self.moe.num_experts,
            num_local_experts=self.moe.num_local_experts,
            device=device,
        )

    def workspace_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8  # byte workspaces: experts carve typed views

    @abstractmethod
    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        a1q_scale: torch.Tensor | None,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
    ) -> None:
        """Write ``sum_k w[t, k] * expert_{ids[t, k]}(x[t])`` into ``output``."""


def _check_inputs(
    moe: FusedMoEConfig,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    tokens = hidden_states.shape[0] if hidden_states.dim() == 2 else -1
    routing = (tokens, moe.experts_per_token)
    for name, ok, expected, got in (
        (
            "hidden_states",
            hidden_states.dim() == 2
            and hidden_states.shape[1] == moe.hidden_size
            and hidden_states.dtype == moe.in_dtype,
            f"[tokens, {moe.hidden_size}] {moe.in_dtype}",
            f"{tuple(hidden_states.shape)} {hidden_states.dtype}",
        ),
        (
            "topk_ids",
            tuple(topk_ids.shape) == routing
            and topk_ids.dtype in (torch.int32, torch.int64)
            and topk_ids.device == hidden_states.device,
            f"{routing} int32/int64 on {hidden_states.device}",
            f"{tuple(topk_ids.shape)} {topk_ids.dtype} on {topk_ids.device}",
        ),
        (
            "topk_weights",
            tuple(topk_weights.shape) == routing
            and topk_weights.dtype == torch.float32
            and topk_weights.device == hidden_states.device,
            f"{routing} float32 on {hidden_states.device}",
            f"{tuple(topk_weights.shape)} {topk_weights.dtype} on "
            f"{topk_weights.device}",
        ),
    ):
        if not ok:
            raise ValueError(f"{name}: expected {expected}, got {got}")


class FusedMoEModularKernel:
    def __init__(
        self,
        prepare_finalize: FusedMoEPrepareAndFinalize,
        experts: FusedMoEExperts,
    ) -> None:
        self.prepare_finalize = prepare_finalize
        self.experts = experts

    def forward(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None = None,
    ) -> torch.Tensor:
        moe = self.experts.moe
        _check_inputs(moe, hidden_states, topk_weights, topk_ids)
        a1q, a1q_scale = self.prepare_finalize.prepare(hidden_states, moe.quant_config)
        shape13, shape2, out_shape = self.experts.workspace_shapes(
            hidden_states.shape[0],
            moe.w13_rows,
            moe.hidden_size,
            topk_ids.shape[1],
            moe.num_experts,
            moe.num_local_experts,
        )
        dtype = self.experts.workspace_dtype(hidden_states.dtype)
        workspace13, workspace2 = get_workspace_buffers(
            hidden_states.device, (shape13, dtype), (shape2, dtype)
        )
        # The output outlives the workspace views (the next layer reuses them).
        output = torch.empty(
            out_shape, dtype=hidden_states.dtype, device=hidden_states.device
        )
        self.experts.apply(
            output,
            a1q,
            a1q_scale,
            topk_weights,
            topk_ids,
            expert_map,
            workspace13,
            workspace2,
        )
        return self.prepare_finalize.finalize(output)
