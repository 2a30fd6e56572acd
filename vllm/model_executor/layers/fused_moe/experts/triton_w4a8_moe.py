"""W4A8 experts: uint4 weights in groups of 128 input columns, fp8
activations per token, on this project's Triton W4A8 grouped GEMMs
(:mod:`~vllm.model_executor.kernels.grouped_gemm.w4a8`).

Weights as :func:`~vllm.model_executor.kernels.grouped_gemm.w4a8.quantize_w4`
lays them out (w13's gate and up rows interleaved for GEMM1): half the bytes
of the FP8 experts. Pipeline, on the shared permute scratch and the
caller's workspaces, with no permuted copy of the activations and no
[R, 2I] intermediate in memory:

1. the tokens are quantized per row into workspace13 ([M, K] fp8 + scales);
2. the routes are sorted by local expert (``moe_prepare_scatter``);
3. GEMM1 reads each row's token straight from workspace13 through the
   sort's destination -> route index and writes ``act(gate, up)`` [R, I]
   into workspace2;
4. a pass quantizes that per row into workspace13 (the tokens are dead);
5. GEMM2 writes its rows into workspace2 (the activation is dead);
6. the unpermute reduces each token's top-k rows into the output.

Decode batches (up to ``DECODE_MAX_TOKENS`` tokens, top-64 at most) skip
all of it but the GEMMs: the uint4 decode kernels of
:mod:`~vllm.model_executor.kernels.marlin.moe_decode` (CUDA-core products
on either packing) stream the packed weights route by route against the
unquantized tokens (w4a16: no activation quantization, no sort) and run
GEMM2 with the sum over each token's routes. Batches up to
``GROUPED_MAX_TOKENS`` on NVIDIA GPUs take :mod:`.uint4_grouped` (the same
numerics; each routed expert's weights read once, on the tensor cores).

CPU tensors take the kernels' plain-PyTorch references.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Self

import torch

from vllm.model_executor.kernels.common.device_info import (
    capability,
    is_hopper,
    runs_gpu_kernels,
)
from vllm.model_executor.kernels.grouped_gemm import (
    DECODE_MAX_TOKENS,
    deinterleave_gate_up,
    interleave_gate_up,
)
from vllm.model_executor.kernels.grouped_gemm.hopper_uint4 import w4_scale_steps
from vllm.model_executor.kernels.grouped_gemm.w4a8 import (
    W4_GROUP,
    dequantize_w4,
    grouped_gemm_w4a8,
    grouped_gemm_w4a8_gated,
    grouped_gemm_w4a8_gated_reference,
    grouped_gemm_w4a8_reference,
    quantize_w4,
)
from vllm.model_executor.kernels.marlin.config import decode_fits_topk
from vllm.model_executor.kernels.marlin.moe_decode import (
    marlin_moe_decode,
    marlin_moe_decode_routed,
)
from vllm.model_executor.layers.fused_moe.activation import quant_rows_fp8
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, QuantScheme
from vllm.model_executor.layers.fused_moe.experts.fp8_channel import (
    carve_fp8_rows,
    fp8_rows_bytes,
)
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
    moe_prepare_scatter,
    moe_unpermute,
)


class TritonExpertsW4A8(FusedMoEExperts):
    supported_schemes = (QuantScheme.W4A8_UINT4,)
    # Token counts up to these take the decode kernels, then the grouped
    # ones (benchmarks lower them).
    decode_max_tokens: int = DECODE_MAX_TOKENS
    grouped_max_tokens: int = GROUPED_MAX_TOKENS

    def __init__(
        self,
        moe: FusedMoEConfig,
        w13: torch.Tensor,
        w13_scale: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
    ) -> None:
        """``w13`` [E, 2I, K / 2] (gate and up rows interleaved) and ``w2``
        [E, K, I / 2] packed uint4, with fp32 scales per row and group."""
        super().__init__(moe)
        self.check_supported(moe, w13.device)
        el, k, i = moe.num_local_experts, moe.hidden_size, moe.intermediate_size
        check_tensors(
            ("w13", w13, (el, 2 * i, k // 2), torch.uint8),
            ("w13_scale", w13_scale, (el, 2 * i, k // W4_GROUP), torch.float32),
            ("w2", w2, (el, k, i // 2), torch.uint8),
            ("w2_scale", w2_scale, (el, k, i // W4_GROUP), torch.float32),
        )
        self.w13, self.w13_scale = w13.contiguous(), w13_scale.contiguous()
        self.w2, self.w2_scale = w2.contiguous(), w2_scale.contiguous()
        # The Hopper kernels' per-group rescaling, computed once here.
        self.w13_steps = self.w2_steps = None
        if is_hopper(w13.device):
            self.w13_steps = w4_scale_steps(self.w13_scale)
            self.w2_steps = w4_scale_steps(self.w2_scale)

    @classmethod
    def unsupported(cls, moe: FusedMoEConfig, device: torch.device) -> str | None:
        """fp8 tensor cores on CUDA, and whole weight groups."""
        reason = super().unsupported(moe, device)
        if reason is not None:
            return reason
        have = capability(device)
        if have is not None and have < (8, 9):
            return (
                f"device: {cls.__name__} needs compute capability (8, 9) or newer, "
                f"got {device} with {have}"
            )
        if moe.hidden_size % W4_GROUP or moe.intermediate_size % W4_GROUP:
            return (
                f"hidden_size/intermediate_size: W4A8 weights come in groups of "
                f"{W4_GROUP}, got {moe.hidden_size}/{moe.intermediate_size}"
            )
        return None

    @classmethod
    def from_unquantized(
        cls, moe: FusedMoEConfig, w13: torch.Tensor, w2: torch.Tensor
    ) -> Self:
        cls.check_supported(moe, w13.device)
        return cls(moe, *quantize_w4(interleave_gate_up(w13)), *quantize_w4(w2))

    def dequantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            deinterleave_gate_up(dequantize_w4(self.w13, self.w13_scale)),
            dequantize_w4(self.w2, self.w2_scale),
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
        rows, inter = M * topk, N // 2
        # workspace13: the tokens in fp8, later the activation rows in fp8;
        # in the grouped kernels' batches the activation rows (16-bit). M is
        # a capacity: a batch of any size up to it may come.
        grouped_rows = min(M, self.grouped_max_tokens) * topk
        workspace13 = max(
            fp8_rows_bytes(M, K),
            fp8_rows_bytes(rows, inter),
            grouped_rows * inter * self.moe.in_dtype.itemsize,
        )
        # workspace2: GEMM1's activation, later GEMM2's rows.
        workspace2 = rows * max(inter, K) * self.moe.in_dtype.itemsize
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
            self.w13,
            self.w13_scale,
            self.w2,
            self.w2_scale,
            expert_map,
            moe.activation,
            W4_GROUP,
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
        rows, inter = topk_ids.numel(), moe.intermediate_size
        num_tokens, hidden = hidden_states.shape
        gpu = runs_gpu_kernels(hidden_states)
        if self.decodes(hidden_states, topk_ids.shape[1]):
            marlin_moe_decode(
                hidden_states,
                topk_ids,
                topk_weights,
                self.w13,
                self.w13_scale,
                self.w2,
                self.w2_scale,
                expert_map,
                moe.activation,
                W4_GROUP,
                carve(workspace2, (rows, inter), output.dtype),
                output,
            )
            return
        if runs_grouped(hidden_states, self.grouped_max_tokens):
            apply_grouped(
                self, output, hidden_states, topk_weights, topk_ids, expert_map,
                (self.w13, self.w13_scale, self.w2, self.w2_scale), W4_GROUP,
                carve(workspace13, (rows, inter), output.dtype),
                carve(workspace2, (rows, hidden), output.dtype),
            )  # fmt: skip
            return
        gated: Callable[..., torch.Tensor]
        gemm: Callable[..., torch.Tensor]
        if gpu:
            gated = partial(grouped_gemm_w4a8_gated, scale_steps=self.w13_steps)
            gemm = partial(grouped_gemm_w4a8, scale_steps=self.w2_steps)
        else:
            gated = grouped_gemm_w4a8_gated_reference
            gemm = grouped_gemm_w4a8_reference
        a_q, a_scale = carve_fp8_rows(workspace13, num_tokens, hidden)
        quant_rows_fp8(hidden_states, a_q, a_scale)
        scratch = self.permute_scratch(hidden_states.device)
        offsets, inv = moe_prepare_scatter(topk_ids, expert_map, scratch)
        act = carve(workspace2, (rows, inter), output.dtype)
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
        row_q, row_scale = carve_fp8_rows(workspace13, rows, inter)
        # Rows past offsets[-1] (non-local routes) hold stale data: they are
        # quantized too (their count is on the device) and never read again.
        quant_rows_fp8(act, row_q, row_scale)
        down = carve(workspace2, (rows, hidden), output.dtype)
        gemm(row_q, row_scale, self.w2, self.w2_scale, offsets, down)
        moe_unpermute(output, down, topk_weights, inv, offsets)
