"""FP8 w8a8 experts on ``torch._scaled_grouped_mm`` (CUTLASS inside on Hopper).

Weights: fp8 e4m3 with one scale per output channel. Activations: quantized
per token into workspace13 before the permute (M rows instead of M x topk),
then the fp8 rows and their scales are permuted into workspace2; after GEMM1
one fused pass applies the gated activation and re-quantizes it per row into
workspace13 (free again by then).
"""

from __future__ import annotations

from typing import Self

import torch

from vllm.model_executor.layers.fused_moe.activation import quant_rows_fp8
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, QuantScheme
from vllm.model_executor.layers.fused_moe.experts.grouped_mm_moe import (
    grouped_mm,
    grouped_mm_ends,
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
from vllm.model_executor.layers.quantization.utils.fp8_utils import (
    FP8_DTYPE,
    per_channel_quant_fp8,
)
from vllm.v1.worker.workspace import align_up


class CutlassExpertsFp8(FusedMoEExperts):
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
        if moe.hidden_size % 16 or moe.intermediate_size % 16:
            raise ValueError(
                "hidden_size/intermediate_size: fp8 grouped GEMMs need multiples of "
                f"16, got {moe.hidden_size}/{moe.intermediate_size}"
            )
        el = moe.num_local_experts
        check_tensors(
            ("w13", w13, (el, moe.w13_rows, moe.hidden_size), FP8_DTYPE),
            ("w13_scale", w13_scale, (el, moe.w13_rows), torch.float32),
            ("w2", w2, (el, moe.hidden_size, moe.intermediate_size), FP8_DTYPE),
            ("w2_scale", w2_scale, (el, moe.hidden_size), torch.float32),
        )
        self.w13, self.w13_scale = w13.contiguous(), w13_scale.contiguous()
        self.w2, self.w2_scale = w2.contiguous(), w2_scale.contiguous()

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

    def gemm_layout(self, expert_first_token_offset: torch.Tensor) -> torch.Tensor:
        """What :meth:`grouped_gemm` takes as the row grouping, computed once
        per layer call for both GEMMs: torch's int32 row ends."""
        return grouped_mm_ends(expert_first_token_offset)

    def grouped_gemm(
        self,
        a: torch.Tensor,
        a_scale: torch.Tensor,
        w: torch.Tensor,
        w_scale: torch.Tensor,
        layout: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """[R, N] in ``out_dtype``; rows past the last expert unspecified.

        The result is allocated by the GEMM (``_scaled_grouped_mm`` has no
        ``out=``), so the pipeline keeps both GEMM outputs out of the
        workspaces for every FP8 backend."""
        return grouped_mm(a, w, layout, a_scale, w_scale, out_dtype)

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
        layout = self.gemm_layout(offsets)
        gate_up = self.grouped_gemm(
            a_perm,
            a_perm_scale.view(-1),
            self.w13,
            self.w13_scale,
            layout,
            output.dtype,
        )
        act_q = carve(workspace13, (rows, inter), FP8_DTYPE)
        act_scale = carve(workspace13, (rows,), torch.float32, align_up(act_q.numel()))
        quant_rows_fp8(gate_up, act_q, act_scale, moe.activation)
        down = self.grouped_gemm(
            act_q, act_scale, self.w2, self.w2_scale, layout, output.dtype
        )
        moe_unpermute(output, down, topk_weights, inv, offsets)
