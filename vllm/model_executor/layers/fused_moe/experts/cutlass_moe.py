"""FP8 w8a8 experts on ``torch._scaled_grouped_mm`` (CUTLASS inside on Hopper).

Weights: fp8 e4m3 with one scale per output channel. Activations: quantized
per token into workspace13 before the permute (M rows instead of M x topk),
then the fp8 rows and their scales are permuted into workspace2; after GEMM1
one fused pass applies the gated activation and re-quantizes it per row into
workspace13 (free again by then). Both GEMM outputs are allocated by torch:
``_scaled_grouped_mm`` has no ``out=`` variant, so they cannot live in the
workspaces (:class:`TritonExpertsFp8` keeps its GEMM outputs there).
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.activation import quant_rows_fp8
from vllm.model_executor.layers.fused_moe.experts.fp8_channel import (
    Fp8ChannelExperts,
    carve_fp8_rows,
    fp8_rows_bytes,
)
from vllm.model_executor.layers.fused_moe.experts.grouped_mm_moe import (
    grouped_mm,
    grouped_mm_ends,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import Shape
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    moe_permute,
    moe_unpermute,
)


class CutlassExpertsFp8(Fp8ChannelExperts):
    min_capability = (9, 0)  # torch._scaled_grouped_mm

    def workspace_shapes(
        self,
        M: int,
        N: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
    ) -> tuple[Shape, Shape, Shape]:
        rows = M * topk
        # workspace13: the M input tokens quantized, then the R activation rows.
        workspace13 = max(fp8_rows_bytes(M, K), fp8_rows_bytes(rows, N // 2))
        workspace2 = fp8_rows_bytes(rows, K)  # the permuted input rows
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
        rows, inter = topk_ids.numel(), moe.intermediate_size
        scratch = self.permute_scratch(hidden_states.device)
        num_tokens, hidden = hidden_states.shape
        a_q, a_scale = carve_fp8_rows(workspace13, num_tokens, hidden)
        quant_rows_fp8(hidden_states, a_q, a_scale)
        a_perm, a_perm_scale = carve_fp8_rows(workspace2, rows, hidden)
        _, _, offsets, inv, _ = moe_permute(
            a_q,
            a_scale.view(num_tokens, 1),
            topk_ids,
            moe.num_experts,
            moe.num_local_experts,
            expert_map,
            permuted_hidden_states=a_perm,
            scratch=scratch,
            permuted_a1q_scale=a_perm_scale.view(rows, 1),
        )
        ends = grouped_mm_ends(offsets)
        gate_up = grouped_mm(
            a_perm, self.w13, ends, a_perm_scale, self.w13_scale, output.dtype
        )
        act_q, act_scale = carve_fp8_rows(workspace13, rows, inter)
        quant_rows_fp8(gate_up, act_q, act_scale, moe.activation)
        down = grouped_mm(act_q, self.w2, ends, act_scale, self.w2_scale, output.dtype)
        moe_unpermute(output, down, topk_weights, inv, offsets)
