"""FP8 w8a8 experts on this project's Triton grouped GEMMs, with the permute
and the activation fused into GEMM1.

Weights as :class:`CutlassExpertsFp8` (fp8, one scale per output channel),
with w13's gate and up rows interleaved for GEMM1.
Pipeline, with no permuted copy of the activations and no [R, 2I]
intermediate in memory:

1. the tokens are quantized per row into workspace13 ([M, K] fp8 + scales);
2. the routes are sorted by local expert (``moe_prepare_scatter``);
3. GEMM1 reads each row's token straight from workspace13 through the
   sort's destination -> route index and writes ``act(gate, up)`` [R, I]
   into workspace2;
4. that is quantized per row into workspace13 (the tokens are dead by then);
5. GEMM2 writes its rows into workspace2 (the activation is dead by then);
6. the unpermute reduces each token's top-k rows into the output.

CPU tensors take the kernels' plain-PyTorch references.
"""

from __future__ import annotations

import torch

from vllm.model_executor.kernels.grouped_gemm_fp8 import (
    deinterleave_gate_up,
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
    grouped_gemm_fp8_gated_reference,
    grouped_gemm_fp8_reference,
    interleave_gate_up,
)
from vllm.model_executor.layers.fused_moe.activation import quant_rows_fp8
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.experts.fp8_channel import (
    Fp8ChannelExperts,
    carve_fp8_rows,
    fp8_rows_bytes,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import Shape, carve
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    moe_prepare_scatter,
    moe_unpermute,
)


class TritonExpertsFp8(Fp8ChannelExperts):
    def __init__(
        self,
        moe: FusedMoEConfig,
        w13: torch.Tensor,
        w13_scale: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
    ) -> None:
        super().__init__(moe, w13, w13_scale, w2, w2_scale)
        # GEMM1 takes its gate and up rows interleaved (one product tile).
        self.w13 = interleave_gate_up(self.w13)
        self.w13_scale = interleave_gate_up(self.w13_scale)

    def dequantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = super().dequantized_weights()
        return deinterleave_gate_up(w13), w2

    def workspace_shapes(
        self,
        M: int,
        N: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
    ) -> tuple[Shape, Shape, Shape]:
        rows, inter = M * topk, N // 2
        # workspace13: the M input tokens quantized, then the R activation rows.
        workspace13 = max(fp8_rows_bytes(M, K), fp8_rows_bytes(rows, inter))
        # workspace2: GEMM1's activation, then GEMM2's rows (16-bit).
        workspace2 = max(rows * inter, rows * K) * self.moe.in_dtype.itemsize
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
        num_tokens, hidden = hidden_states.shape
        a_q, a_scale = carve_fp8_rows(workspace13, num_tokens, hidden)
        quant_rows_fp8(hidden_states, a_q, a_scale)
        scratch = self.permute_scratch(hidden_states.device)
        offsets, inv = moe_prepare_scatter(topk_ids, expert_map, scratch)
        act = carve(workspace2, (rows, inter), output.dtype)
        cuda = hidden_states.is_cuda
        gated = grouped_gemm_fp8_gated if cuda else grouped_gemm_fp8_gated_reference
        gated(
            a_q,
            a_scale,
            scratch.permuted_idx[:rows],
            topk_ids.shape[1],
            self.w13,
            self.w13_scale,
            offsets,
            moe.activation,
            act,
        )
        act_q, act_scale = carve_fp8_rows(workspace13, rows, inter)
        # Rows past offsets[-1] (non-local routes) hold stale data: they are
        # quantized too (their count is on the device) and never read again.
        quant_rows_fp8(act, act_q, act_scale)
        down = carve(workspace2, (rows, hidden), output.dtype)
        gemm = grouped_gemm_fp8 if cuda else grouped_gemm_fp8_reference
        gemm(act_q, act_scale, self.w2, self.w2_scale, offsets, down)
        moe_unpermute(output, down, topk_weights, inv, offsets)
