"""The modular MoE kernel: prepare -> experts.apply -> finalize.

``FusedMoEPrepareAndFinalize`` moves activations and their routing to the
experts (optionally quantizing them first) and the experts' output back: a
single process here (:class:`MoEPrepareAndFinalizeNoEP`), across
expert-parallel ranks in ``fused_moe.prepare_finalize``. ``FusedMoEExperts``
computes the experts on the routed tokens. The modular kernel takes both of
the experts' workspaces from the workspace manager in one
``get_simultaneous`` call, so every MoE layer of a slot shares them.

Without dispatch, experts whose decode kernels route a token from the
router's logits themselves (:meth:`FusedMoEExperts.routes_from_logits`)
take the logits instead of top-k ids (:meth:`FusedMoEModularKernel.forward_routed`):
at decode sizes the routing then costs no launch of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Self, TypeVar

import torch

from vllm.model_executor.kernels.common.fp8 import (
    per_token_group_quant_fp8,
)
from vllm.model_executor.kernels.common.topk_softmax import TOP_ROUTES_MAX_EXPERTS
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


@dataclass
class PrepareResult:
    """What the experts of this rank compute on: activations (quantized when
    the scheme says so) with their scales, and the routing of those rows.

    ``capacity_tokens`` bounds the rows the experts may be given on any rank
    in this step (the same on every rank); workspaces and the permute scratch
    are sized for it, so a rank warmed up at the engine's token budget never
    grows after lock, whatever the routing sends it.
    """

    a1q: torch.Tensor
    a1q_scale: torch.Tensor | None
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    capacity_tokens: int


PrepareT = TypeVar("PrepareT", bound=PrepareResult)


def quantize_input(
    a1: torch.Tensor, quant_config: FusedMoEQuantConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """With a prequantized scheme (block FP8) the activations are quantized
    before dispatch, in groups of ``block_size`` along the hidden dimension;
    otherwise they pass through without scales."""
    if quant_config.prequantized:
        return per_token_group_quant_fp8(a1, quant_config.block_size)
    return a1, None


class FusedMoEPrepareAndFinalize(ABC, Generic[PrepareT]):
    """Moves tokens and their routing to the ranks whose experts they need
    (prepare) and the experts' outputs back to the tokens' rank (finalize).

    ``prepare`` returns what ``finalize`` needs (its :class:`PrepareResult`
    subclass), so concurrent micro-batches never share dispatch state.
    """

    @abstractmethod
    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        quant_config: FusedMoEQuantConfig,
    ) -> PrepareT:
        """Dispatch this rank's tokens ``a1`` [T, H] and their routing."""

    @abstractmethod
    def finalize(self, fused_out: torch.Tensor, prepared: PrepareT) -> torch.Tensor:
        """The layer output [T, H] of this rank's tokens from the experts'
        output (one row per row of ``prepared.a1q``, weighted over the routes
        computed here)."""


class MoEPrepareAndFinalizeNoEP(FusedMoEPrepareAndFinalize[PrepareResult]):
    """Single process: no dispatch or combine (a layer with ``ep_size`` > 1
    but no group computes its local experts' share only)."""

    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        quant_config: FusedMoEQuantConfig,
    ) -> PrepareResult:
        a1q, a1q_scale = quantize_input(a1, quant_config)
        return PrepareResult(a1q, a1q_scale, topk_weights, topk_ids, a1.shape[0])

    def finalize(
        self, fused_out: torch.Tensor, prepared: PrepareResult
    ) -> torch.Tensor:
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

    def decodes(self, hidden_states: torch.Tensor, topk: int) -> bool:
        """Whether :meth:`apply` takes route-by-route decode kernels for
        these tokens at top-``topk``; experts that have them say when, and
        implement :meth:`apply_routed` on them."""
        return False

    def routes_from_logits(self, hidden_states: torch.Tensor) -> bool:
        """Whether :meth:`apply_routed` takes ``hidden_states``: where the
        decode kernels run, among at most ``TOP_ROUTES_MAX_EXPERTS``."""
        moe = self.moe
        return moe.num_experts <= TOP_ROUTES_MAX_EXPERTS and self.decodes(
            hidden_states, moe.experts_per_token
        )

    def apply_routed(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        renormalize: bool,
        expert_map: torch.Tensor | None,
        workspace2: torch.Tensor,
    ) -> None:
        """:meth:`apply` of the softmax top-k routing of ``router_logits``
        [T, E], computed inside the experts' kernels."""
        raise NotImplementedError(f"{type(self).__name__} routes by top-k ids only")


def _check_hidden_states(moe: FusedMoEConfig, hidden_states: torch.Tensor) -> int:
    """The token count of ``hidden_states``, or raise naming it."""
    if not (
        hidden_states.dim() == 2
        and hidden_states.shape[1] == moe.hidden_size
        and hidden_states.dtype == moe.in_dtype
    ):
        raise ValueError(
            f"hidden_states: expected [tokens, {moe.hidden_size}] {moe.in_dtype}, "
            f"got {tuple(hidden_states.shape)} {hidden_states.dtype}"
        )
    return hidden_states.shape[0]


def _check_inputs(
    moe: FusedMoEConfig,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    routing = (_check_hidden_states(moe, hidden_states), moe.experts_per_token)
    for name, ok, expected, got in (
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
        prepare_finalize: FusedMoEPrepareAndFinalize[Any],
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
        prepared = self.prepare_finalize.prepare(
            hidden_states, topk_weights, topk_ids, moe.quant_config
        )
        a1q, topk = prepared.a1q, topk_ids.shape[1]
        capacity = prepared.capacity_tokens
        output, workspace13, workspace2 = self._buffers(
            a1q.shape[0], capacity, a1q.device
        )
        self.experts.permute_scratch(a1q.device).reserve(capacity * topk)
        self.experts.apply(
            output,
            a1q,
            prepared.a1q_scale,
            prepared.topk_weights,
            prepared.topk_ids,
            expert_map,
            workspace13,
            workspace2,
        )
        return self.prepare_finalize.finalize(output, prepared)

    def routes_from_logits(self, hidden_states: torch.Tensor) -> bool:
        """Whether :meth:`forward_routed` takes ``hidden_states``: no dispatch
        (every rank holds the tokens) nor quantization before it, and experts
        whose kernels route from logits at this size."""
        return (
            isinstance(self.prepare_finalize, MoEPrepareAndFinalizeNoEP)
            and not self.experts.moe.quant_config.prequantized
            and self.experts.routes_from_logits(hidden_states)
        )

    def forward_routed(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        renormalize: bool,
        expert_map: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` of the softmax top-k routing of ``router_logits``
        [T, E], which the experts' kernels compute (only where
        :meth:`routes_from_logits`)."""
        moe = self.experts.moe
        tokens = _check_hidden_states(moe, hidden_states)
        if not self.routes_from_logits(hidden_states):
            raise ValueError(
                f"hidden_states: {type(self.experts).__name__} with "
                f"{type(self.prepare_finalize).__name__} routes "
                f"{tuple(hidden_states.shape)} on {hidden_states.device} by "
                f"top-k ids only: call forward()"
            )
        expected = (tokens, moe.num_experts)
        if (
            tuple(router_logits.shape) != expected
            or router_logits.dtype != moe.in_dtype
            or router_logits.device != hidden_states.device
        ):
            raise ValueError(
                f"router_logits: expected {expected} (tokens, global experts) "
                f"{moe.in_dtype} on {hidden_states.device}, got "
                f"{tuple(router_logits.shape)} {router_logits.dtype} on "
                f"{router_logits.device}"
            )
        output, _, workspace2 = self._buffers(tokens, tokens, hidden_states.device)
        self.experts.apply_routed(
            output, hidden_states, router_logits, renormalize, expert_map, workspace2
        )
        # No prepare (nothing moves), but the finalize may sum the ranks'
        # partial outputs (tensor parallel); it reads no routing.
        unrouted = router_logits[:, :0]  # a view: nothing allocated per call
        prepared = PrepareResult(hidden_states, None, unrouted, unrouted, tokens)
        return self.prepare_finalize.finalize(output, prepared)

    def _buffers(
        self, rows: int, capacity: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The output for the experts' ``rows`` input rows and their two
        workspaces, sized for ``capacity`` tokens."""
        moe = self.experts.moe
        shape13, shape2, out_shape = self.experts.workspace_shapes(
            capacity,
            moe.w13_rows,
            moe.hidden_size,
            moe.experts_per_token,
            moe.num_experts,
            moe.num_local_experts,
        )
        dtype = self.experts.workspace_dtype(moe.in_dtype)
        workspace13, workspace2 = get_workspace_buffers(
            device, (shape13, dtype), (shape2, dtype)
        )
        # The output outlives the workspace views (the next layer reuses
        # them); its rows are the experts' input rows, not the capacity.
        output = torch.empty((rows, *out_shape[1:]), dtype=moe.in_dtype, device=device)
        return output, workspace13, workspace2
