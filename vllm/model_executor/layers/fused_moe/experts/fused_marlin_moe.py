"""W4A16 (uint4, group 128) experts on this project's Marlin-style grouped GEMM.

Weights are quantized and repacked once per expert
(:meth:`MarlinExperts.from_unquantized`). Per call: ``moe_permute`` groups the
routed rows by local expert into workspace13; grouped GEMM1 -> workspace2;
gated activation -> workspace13; grouped GEMM2 -> workspace2;
``moe_unpermute`` reduces into the output. Decode batches (up to
``MARLIN_DECODE_MAX_TOKENS`` tokens) skip the sort: :func:`marlin_moe_decode`
runs each route's GEMM1 into workspace13, then GEMM2 and the sum over each
token's routes in one kernel straight into the output. Batches up to
``GROUPED_MAX_TOKENS`` on NVIDIA GPUs take :mod:`.uint4_grouped` (each
routed expert's weights read once, on the tensor cores).

CUDA tensors run the Triton kernel (:func:`marlin_gemm_grouped`: no host sync,
capturable); CPU tensors run a reference (dequantize, one matmul per expert).
The permute scratch and the split-K lock buffer come from the workspace
manager inside :meth:`MarlinExperts.apply`; the object holds weights only.
"""

from __future__ import annotations

import torch

from vllm.model_executor.kernels.common.device_info import runs_gpu_kernels
from vllm.model_executor.kernels.marlin import marlin_gemm_grouped
from vllm.model_executor.kernels.marlin.config import decode_fits_topk
from vllm.model_executor.kernels.marlin.moe_decode import (
    marlin_moe_decode,
    marlin_moe_decode_routed,
)
from vllm.model_executor.layers.fused_moe.activation import apply_moe_activation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, QuantScheme
from vllm.model_executor.layers.fused_moe.experts.uint4_grouped import (
    GROUPED_MAX_TOKENS,
    apply_grouped,
    runs_grouped,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEExperts,
    Shape,
    carve,
    check_tensors,
)
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    moe_permute,
    moe_unpermute,
)
from vllm.model_executor.layers.quantization.utils.marlin_utils import (
    get_marlin_workspace,
    marlin_dequantize,
    marlin_quantize_and_repack,
)

GROUP_SIZE = 128  # scales per 128 input channels (QuantScheme.W4A16_UINT4)
# Up to this many tokens the route-by-route decode kernels run: per-route
# weight reads cost little while few tokens share an expert (at
# qwen3-30b-a3b dims, H100: 71.4 us at 8 tokens against 76.9 for the grouped
# kernels; at 16 the grouped ones win, 111.6 against 114.1: RESULTS.md).
MARLIN_DECODE_MAX_TOKENS = 8


def _grouped_gemm(
    a: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    workspace: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out[rows of e] = a[rows of e] @ dequant(packed[e], scales[e])^T``."""
    size_n, size_k = packed.shape[1], a.shape[1]
    if runs_gpu_kernels(a):
        marlin_gemm_grouped(
            a,
            packed,
            scales,
            expert_first_token_offset,
            workspace,
            group_size=GROUP_SIZE,
            size_n=size_n,
            size_k=size_k,
            out=out,
        )
        return
    # Reference: one fp32 matmul per non-empty expert (host sync is fine here).
    bounds = expert_first_token_offset.tolist()
    for e in range(packed.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo < hi:
            weight = marlin_dequantize(packed[e], scales[e], GROUP_SIZE).float()
            out[lo:hi] = (a[lo:hi].float() @ weight.t()).to(out.dtype)


class MarlinExperts(FusedMoEExperts):
    """uint4 experts: permute -> GEMM1 -> activation -> GEMM2 -> unpermute.

    ``w13``: packed ``[E_local, 2I, K // 8]`` int32 with scales ``[E_local,
    K // 128, 2I]``; ``w2``: packed ``[E_local, K, I // 8]`` with scales
    ``[E_local, I // 128, K]``; scales in ``moe.in_dtype``.
    """

    supported_schemes = (QuantScheme.W4A16_UINT4,)
    # Token counts up to these take the decode kernels, then the grouped
    # ones (benchmarks lower them).
    decode_max_tokens: int = MARLIN_DECODE_MAX_TOKENS
    grouped_max_tokens: int = GROUPED_MAX_TOKENS

    def __init__(
        self,
        moe: FusedMoEConfig,
        w13_packed: torch.Tensor,
        w13_scales: torch.Tensor,
        w2_packed: torch.Tensor,
        w2_scales: torch.Tensor,
    ) -> None:
        super().__init__(moe)
        self.check_supported(moe, w13_packed.device)
        el, k, i = moe.num_local_experts, moe.hidden_size, moe.intermediate_size
        check_tensors(
            ("w13_packed", w13_packed, (el, 2 * i, k // 8), torch.int32),
            ("w13_scales", w13_scales, (el, k // GROUP_SIZE, 2 * i), moe.in_dtype),
            ("w2_packed", w2_packed, (el, k, i // 8), torch.int32),
            ("w2_scales", w2_scales, (el, i // GROUP_SIZE, k), moe.in_dtype),
        )
        self.w13_packed = w13_packed.contiguous()
        self.w13_scales = w13_scales.contiguous()
        self.w2_packed = w2_packed.contiguous()
        self.w2_scales = w2_scales.contiguous()

    @classmethod
    def unsupported(cls, moe: FusedMoEConfig, device: torch.device) -> str | None:
        """Sizes must be whole quantization groups (and the kernels' K steps)."""
        reason = super().unsupported(moe, device)
        if reason is not None:
            return reason
        for name, size in (
            ("hidden_size", moe.hidden_size),
            ("intermediate_size", moe.intermediate_size),
        ):
            if size % GROUP_SIZE:
                return f"{name}: expected a multiple of {GROUP_SIZE}, got {size}"
        return None

    @classmethod
    def from_unquantized(
        cls, moe: FusedMoEConfig, w13: torch.Tensor, w2: torch.Tensor
    ) -> MarlinExperts:
        """Quantize and repack ``w13 [E_local, 2I, K]``, ``w2 [E_local, K, I]``."""
        cls.check_supported(moe, w13.device)
        el, k, i = moe.num_local_experts, moe.hidden_size, moe.intermediate_size
        check_tensors(("w13", w13, (el, 2 * i, k), None), ("w2", w2, (el, k, i), None))

        def prepare(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            per_expert = [
                marlin_quantize_and_repack(w[e], GROUP_SIZE, moe.in_dtype)
                for e in range(el)
            ]
            return (
                torch.stack([packed for packed, _ in per_expert]),
                torch.stack([scales for _, scales in per_expert]),
            )

        return cls(moe, *prepare(w13), *prepare(w2))

    def dequantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [E_local, 2I, K], w2 [E_local, K, I])`` as the kernel sees them."""

        def dequant(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
            return torch.stack(
                [
                    marlin_dequantize(packed[e], scales[e], GROUP_SIZE)
                    for e in range(packed.shape[0])
                ]
            )

        return (
            dequant(self.w13_packed, self.w13_scales),
            dequant(self.w2_packed, self.w2_scales),
        )

    def workspace_shapes(
        self,
        M: int,
        N: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
    ) -> tuple[Shape, Shape, Shape]:
        itemsize = self.moe.in_dtype.itemsize
        rows = M * topk
        # workspace13: permuted activations, then the activation output.
        workspace13 = rows * max(K, N // 2) * itemsize
        # workspace2: GEMM1 output, then GEMM2 output.
        workspace2 = rows * max(N, K) * itemsize
        return (workspace13,), (workspace2,), (M, K)

    def decodes(self, hidden_states: torch.Tensor, topk: int) -> bool:
        return (
            runs_gpu_kernels(hidden_states)
            and hidden_states.shape[0] <= self.decode_max_tokens
            and decode_fits_topk(topk)  # else the sorted path
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
        moe = self.moe
        rows = hidden_states.shape[0] * moe.experts_per_token
        marlin_moe_decode_routed(
            hidden_states,
            router_logits,
            moe.experts_per_token,
            renormalize,
            self.w13_packed,
            self.w13_scales,
            self.w2_packed,
            self.w2_scales,
            expert_map,
            moe.activation,
            GROUP_SIZE,
            carve(workspace2, (rows, moe.intermediate_size), output.dtype),
            output,
        )

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
        moe = self.moe
        if hidden_states.dtype != moe.in_dtype:
            raise ValueError(
                f"hidden_states: expected {moe.in_dtype}, got {hidden_states.dtype}"
            )
        rows, dtype, device = topk_ids.numel(), moe.in_dtype, hidden_states.device
        k, i = moe.hidden_size, moe.intermediate_size
        if self.decodes(hidden_states, topk_ids.shape[1]):
            marlin_moe_decode(
                hidden_states,
                topk_ids,
                topk_weights,
                self.w13_packed,
                self.w13_scales,
                self.w2_packed,
                self.w2_scales,
                expert_map,
                moe.activation,
                GROUP_SIZE,
                carve(workspace13, (rows, i), dtype),
                output,
            )
            return
        if runs_grouped(hidden_states, self.grouped_max_tokens):
            apply_grouped(
                self, output, hidden_states, topk_weights, topk_ids, expert_map,
                (self.w13_packed, self.w13_scales, self.w2_packed, self.w2_scales),
                GROUP_SIZE, carve(workspace13, (rows, i), dtype),
                carve(workspace2, (rows, k), dtype),
            )  # fmt: skip
            return
        scratch = self.permute_scratch(device)
        locks = get_marlin_workspace(device)  # this slot's and stream's
        a_perm = carve(workspace13, (rows, k), dtype)
        _, _, offsets, inv, _ = moe_permute(
            hidden_states,
            None,
            topk_ids,
            moe.num_experts,
            moe.num_local_experts,
            expert_map,
            permuted_hidden_states=a_perm,
            scratch=scratch,
        )
        gate_up = carve(workspace2, (rows, 2 * i), dtype)
        _grouped_gemm(a_perm, self.w13_packed, self.w13_scales, offsets, locks, gate_up)
        act = carve(workspace13, (rows, i), dtype)
        apply_moe_activation(moe.activation, act, gate_up)
        down = carve(workspace2, (rows, k), dtype)
        _grouped_gemm(act, self.w2_packed, self.w2_scales, offsets, locks, down)
        moe_unpermute(output, down, topk_weights, inv, offsets)
