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
)
from vllm.model_executor.layers.fused_moe.experts.grouped_mm_moe import (
    grouped_mm,
    grouped_mm_ends,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import Shape, carve
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    moe_permute,
    moe_unpermute,
)
from vllm.model_executor.layers.quantization.utils.fp8_utils import FP8_DTYPE
from vllm.v1.worker.workspace import align_up


class CutlassExpertsFp8(Fp8ChannelExperts):
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
        # workspace13: fp8 rows + row scales, first of the M input tokens,
        # then of the R activation rows.
        workspace13 = max(align_up(M * K) + M * 4, align_up(rows * (N // 2)) + rows * 4)
        workspace2 = align_up(rows * K) + rows * 4  # permuted fp8 rows + scales
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
        a_q = carve(workspace13, (num_tokens, hidden), FP8_DTYPE)
        a_scale = carve(
            workspace13, (num_tokens,), torch.float32, align_up(a_q.numel())
        )
        quant_rows_fp8(hidden_states, a_q, a_scale)
        a_perm = carve(workspace2, (rows, hidden), FP8_DTYPE)
        a_perm_scale = carve(
            workspace2, (rows, 1), torch.float32, align_up(a_perm.numel())
        )
        _, _, offsets, inv, _ = moe_permute(
            a_q,
            a_scale.view(num_tokens, 1),
            topk_ids,
            moe.num_experts,
            moe.num_local_experts,
            expert_map,
            permuted_hidden_states=a_perm,
            scratch=scratch,
            permuted_a1q_scale=a_perm_scale,
        )
        ends = grouped_mm_ends(offsets)
        gate_up = grouped_mm(
            a_perm, self.w13, ends, a_perm_scale.view(-1), self.w13_scale, output.dtype
        )
        act_q = carve(workspace13, (rows, inter), FP8_DTYPE)
        act_scale = carve(workspace13, (rows,), torch.float32, align_up(act_q.numel()))
        quant_rows_fp8(gate_up, act_q, act_scale, moe.activation)
        down = grouped_mm(act_q, self.w2, ends, act_scale, self.w2_scale, output.dtype)
        moe_unpermute(output, down, topk_weights, inv, offsets)
