"""Unquantized (bf16/fp16) experts on this project's Hopper grouped GEMMs,
with the permute and the activation fused into GEMM1.

:class:`TritonExpertsFp8`'s pipeline without the quantization:

1. the routes are sorted by local expert (``moe_prepare_scatter``);
2. GEMM1 reads each row's token straight from the input through the sort's
   destination -> route index and writes ``act(gate, up)`` [R, I] into
   workspace2;
3. GEMM2 reads that and writes its rows into workspace13;
4. the unpermute reduces each token's top-k rows into the output.

Against :class:`GroupedMMExperts` (``torch._grouped_mm``, which takes
permuted contiguous rows and returns the whole [R, 2I] product) this leaves
out the permuted copy of the tokens, the product and the activation pass:
~600 MB of traffic at 8192 tokens with qwen3-30b-a3b dims.

The kernels are Hopper's (:mod:`grouped_gemm_bf16`): other GPUs are refused
at construction and keep ``grouped_mm``. CPU tensors take the kernels'
plain-PyTorch references.
"""

from __future__ import annotations

import torch

from vllm.model_executor.kernels.device_info import capability
from vllm.model_executor.kernels.grouped_gemm_bf16 import (
    grouped_gemm_bf16,
    grouped_gemm_bf16_gated,
    grouped_gemm_bf16_gated_reference,
    grouped_gemm_bf16_reference,
)
from vllm.model_executor.kernels.grouped_gemm_fp8 import (
    deinterleave_gate_up,
    interleave_gate_up,
)
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, QuantScheme
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEExperts,
    Shape,
    carve,
    check_tensors,
)
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    moe_prepare_scatter,
    moe_unpermute,
)


class TritonExperts(FusedMoEExperts):
    supported_schemes = (QuantScheme.UNQUANTIZED,)

    def __init__(
        self, moe: FusedMoEConfig, w13: torch.Tensor, w2: torch.Tensor
    ) -> None:
        super().__init__(moe)
        el = moe.num_local_experts
        check_tensors(
            ("w13", w13, (el, moe.w13_rows, moe.hidden_size), moe.in_dtype),
            ("w2", w2, (el, moe.hidden_size, moe.intermediate_size), moe.in_dtype),
        )
        if moe.hidden_size % 8 or moe.intermediate_size % 8:
            raise ValueError(
                "hidden_size/intermediate_size: the triton backend needs multiples "
                f"of 8 (16-byte rows), got {moe.hidden_size}/{moe.intermediate_size}"
            )
        if w13.is_cuda and capability(w13.device) != (9, 0):
            raise ValueError(
                f"backend 'triton': its bf16 kernels run on Hopper (sm90) only, got "
                f"{w13.device} with capability {capability(w13.device)}; use "
                f"'grouped_mm'"
            )
        # GEMM1 takes its gate and up rows interleaved (one product tile).
        self.w13 = interleave_gate_up(w13)
        self.w2 = w2.contiguous()

    def dequantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return deinterleave_gate_up(self.w13), self.w2

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
        workspace13 = rows * K * itemsize  # GEMM2's rows
        workspace2 = rows * (N // 2) * itemsize  # the activation
        return (workspace13,), (workspace2,), (M, K)

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
        rows, dtype = topk_ids.numel(), hidden_states.dtype
        scratch = self.permute_scratch(hidden_states.device)
        offsets, inv = moe_prepare_scatter(topk_ids, expert_map, scratch)
        cuda = hidden_states.is_cuda
        gated = grouped_gemm_bf16_gated if cuda else grouped_gemm_bf16_gated_reference
        gemm = grouped_gemm_bf16 if cuda else grouped_gemm_bf16_reference
        act = carve(workspace2, (rows, moe.intermediate_size), dtype)
        gated(
            hidden_states,
            scratch.permuted_idx[:rows],
            topk_ids.shape[1],
            self.w13,
            offsets,
            moe.activation,
            act,
        )
        down = carve(workspace13, (rows, moe.hidden_size), dtype)
        gemm(act, self.w2, offsets, down)
        moe_unpermute(output, down, topk_weights, inv, offsets)
