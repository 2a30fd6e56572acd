"""FP8 w8a8 experts on this project's Triton grouped GEMMs, with the permute
and the activation fused into GEMM1.

Weights as :class:`CutlassExpertsFp8` (fp8, one scale per output channel),
with w13's gate and up rows interleaved for GEMM1.
Pipeline, with no permuted copy of the activations and no [R, 2I]
intermediate in memory:

1. the tokens are quantized per row into workspace13 ([M, K] fp8 + scales);
2. the routes are sorted by local expert (``moe_prepare_scatter``);
3. GEMM1 reads each row's token straight from workspace13 through the
   sort's destination -> route index and writes ``act(gate, up)`` [R, I];
4. GEMM2 reads that, quantized to fp8, and writes its rows into workspace2;
5. the unpermute reduces each token's top-k rows into the output.

Decode batches (up to ``DECODE_MAX_TOKENS`` tokens) skip all of it but the
GEMMs: :mod:`~vllm.model_executor.kernels.grouped_gemm.decode` runs GEMM1
route by route on the unquantized tokens (w8a16) and GEMM2 with the
unpermute in one kernel.

Where both GEMMs run the Hopper kernels (above 64 routes per local expert
on average), GEMM1 quantizes its own output in groups of 128 columns, into
workspace13 after the tokens, and GEMM2 takes the group scales. Otherwise
GEMM1 writes bf16 into workspace2 and a pass quantizes it per row into
workspace13 (the tokens are dead by then) before GEMM2 overwrites
workspace2.

Which kernels run is :mod:`~vllm.model_executor.kernels.grouped_gemm`'s
dispatch: the Triton kernels, or on Hopper the warp-specialized Gluon ones.
CPU tensors take the kernels' plain-PyTorch references.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from vllm.model_executor.kernels.common.device_info import runs_gpu_kernels
from vllm.model_executor.kernels.grouped_gemm import (
    DECODE_MAX_TOKENS,
    act_groups,
    deinterleave_gate_up,
    grouped_gemm_fp8,
    grouped_gemm_fp8_gated,
    grouped_gemm_fp8_gated_reference,
    grouped_gemm_fp8_reference,
    interleave_gate_up,
    moe_decode,
    moe_decode_routed,
    moe_gemm_kernels,
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
from vllm.utils import align_up
from vllm.v1.worker.workspace import ALIGNMENT


class TritonExpertsFp8(Fp8ChannelExperts):
    # Token counts up to this take the decode kernels (benchmarks lower it).
    decode_max_tokens: int = DECODE_MAX_TOKENS

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
        # workspace13: the M input tokens quantized, then the R activation rows
        # quantized: after them in groups, or per row in their place. Sized for
        # the first, larger layout whichever path runs (+17 MiB at 8192
        # tokens, qwen3-30b-a3b dims), so the size does not depend on the GPU.
        groups_bytes = fp8_rows_bytes(rows, inter, act_groups(inter))
        workspace13 = align_up(fp8_rows_bytes(M, K), ALIGNMENT) + groups_bytes
        # workspace2: GEMM1's bf16 activation (per-row path), then GEMM2's rows.
        workspace2 = max(rows * inter, rows * K) * self.moe.in_dtype.itemsize
        return (workspace13,), (workspace2,), (M, K)

    def decodes(self, hidden_states: torch.Tensor, topk: int) -> bool:
        return (
            runs_gpu_kernels(hidden_states)
            and hidden_states.shape[0] <= self.decode_max_tokens
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
        act = carve(workspace2, (rows, moe.intermediate_size), output.dtype)
        moe_decode_routed(
            hidden_states,
            router_logits,
            moe.experts_per_token,
            renormalize,
            self.w13,
            self.w13_scale,
            self.w2,
            self.w2_scale,
            expert_map,
            moe.activation,
            act,
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
        rows, inter = topk_ids.numel(), moe.intermediate_size
        num_tokens, hidden = hidden_states.shape
        if self.decodes(hidden_states, topk_ids.shape[1]):
            act = carve(workspace2, (rows, inter), output.dtype)
            moe_decode(
                hidden_states,
                topk_ids,
                topk_weights,
                self.w13,
                self.w13_scale,
                self.w2,
                self.w2_scale,
                expert_map,
                moe.activation,
                act,
                output,
            )
            return
        a_q, a_scale = carve_fp8_rows(workspace13, num_tokens, hidden)
        quant_rows_fp8(hidden_states, a_q, a_scale)
        scratch = self.permute_scratch(hidden_states.device)
        offsets, inv = moe_prepare_scatter(topk_ids, expert_map, scratch)
        gemm1_args = (
            a_q,
            a_scale,
            scratch.permuted_idx[:rows],
            topk_ids.shape[1],
            self.w13,
            self.w13_scale,
            offsets,
            moe.activation,
        )
        tokens_bytes = align_up(fp8_rows_bytes(num_tokens, hidden), ALIGNMENT)
        act_q, group_scale = carve_fp8_rows(
            workspace13, rows, inter, act_groups(inter), tokens_bytes
        )
        down = carve(workspace2, (rows, hidden), output.dtype)
        # The layer's one kernel decision, passed to the launchers.
        kernels = moe_gemm_kernels(a_q, self.w13, act_q, self.w2, down)
        gated: Callable[..., torch.Tensor]
        gemm: Callable[..., torch.Tensor]
        if runs_gpu_kernels(hidden_states):
            gated = functools.partial(grouped_gemm_fp8_gated, kernel=kernels.gemm1)
            gemm = functools.partial(grouped_gemm_fp8, kernel=kernels.gemm2)
        else:
            gated, gemm = grouped_gemm_fp8_gated_reference, grouped_gemm_fp8_reference
        if kernels.group_scales:
            gated(*gemm1_args, act_q, out_scale=group_scale)
            gemm(act_q, group_scale, self.w2, self.w2_scale, offsets, down)
        else:
            act = carve(workspace2, (rows, inter), output.dtype)
            gated(*gemm1_args, act)
            row_q, row_scale = carve_fp8_rows(workspace13, rows, inter)
            # Rows past offsets[-1] (non-local routes) hold stale data: they are
            # quantized too (their count is on the device) and never read again.
            quant_rows_fp8(act, row_q, row_scale)
            gemm(row_q, row_scale, self.w2, self.w2_scale, offsets, down)
        moe_unpermute(output, down, topk_weights, inv, offsets)
