"""Unquantized (bf16/fp16) experts on this project's Hopper grouped GEMMs,
with the permute and the activation fused into GEMM1.

:class:`TritonExpertsFp8`'s pipeline without the quantization:

1. the routes are sorted by local expert (``moe_prepare_scatter``);
2. GEMM1 reads each row's token straight from the input through the sort's
   destination -> route index and writes ``act(gate, up)`` [R, I] into
   workspace2;
3. GEMM2 reads that and writes its rows into workspace13;
4. the unpermute reduces each token's top-k rows into the output.

Decode batches (up to ``DECODE_MAX_TOKENS`` tokens) skip the sort: GEMM1
route by route into workspace2, then GEMM2 and the unpermute in one kernel
(:mod:`~vllm.model_executor.kernels.grouped_gemm.decode`).

Against :class:`GroupedMMExperts` (``torch._grouped_mm``, which takes
permuted contiguous rows and returns the whole [R, 2I] product) this leaves
out the permuted copy of the tokens, the product and the activation pass:
~600 MB of traffic at 8192 tokens with qwen3-30b-a3b dims.

The kernels are Hopper's (16-bit operands run only the warp-specialized
Gluon kernels of :mod:`~vllm.model_executor.kernels.grouped_gemm`): other
GPUs and shapes they cannot take are refused at construction
(:meth:`TritonExperts.unsupported`, which ``auto`` asks) and keep
``grouped_mm``. CPU tensors take the kernels' plain-PyTorch references.
"""

from __future__ import annotations

import torch

from vllm.model_executor.kernels.common.device_info import (
    capability,
    is_hopper,
    runs_gpu_kernels,
)
from vllm.model_executor.kernels.grouped_gemm import (
    DECODE_MAX_TOKENS,
    deinterleave_gate_up,
    grouped_gemm,
    grouped_gemm_gated,
    grouped_gemm_gated_reference,
    grouped_gemm_reference,
    interleave_gate_up,
    moe_decode,
    moe_decode_routed,
)
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.experts.unquantized import (
    UnquantizedExperts,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import carve
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    moe_prepare_scatter,
    moe_unpermute,
)


class TritonExperts(UnquantizedExperts):
    # Token counts up to this take the decode kernels (benchmarks lower it).
    decode_max_tokens: int = DECODE_MAX_TOKENS

    def __init__(
        self, moe: FusedMoEConfig, w13: torch.Tensor, w2: torch.Tensor
    ) -> None:
        super().__init__(moe, w13, w2)
        # GEMM1 takes its gate and up rows interleaved (one product tile).
        self.w13 = interleave_gate_up(w13)
        self.w2 = w2.contiguous()

    @classmethod
    def unsupported(cls, moe: FusedMoEConfig, device: torch.device) -> str | None:
        """Its kernels are Hopper's (the CPU runs their references), GEMM1
        gathers token rows by 16-byte copies (hidden_size a multiple of 16)
        and the activation's rows are TMA boxes (intermediate_size a multiple
        of 8); ``grouped_mm`` runs the rest."""
        reason = super().unsupported(moe, device)
        if reason is not None:
            return reason
        if device.type == "cuda" and not is_hopper(device):
            return (
                f"device: expected a Hopper GPU (sm90) or the CPU, got {device} "
                f"(capability {capability(device)})"
            )
        if moe.hidden_size % 16 or moe.intermediate_size % 8:
            return (
                f"hidden_size/intermediate_size: expected multiples of 16/8, got "
                f"{moe.hidden_size}/{moe.intermediate_size}"
            )
        return None

    def dequantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return deinterleave_gate_up(self.w13), self.w2

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
            None,
            self.w2,
            None,
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
        rows, dtype = topk_ids.numel(), hidden_states.dtype
        if not hidden_states.is_contiguous() or hidden_states.data_ptr() % 16:
            # GEMM1 reads token rows by 16-byte copies: copy a strided input.
            hidden_states = hidden_states.clone(memory_format=torch.contiguous_format)
        kernels = runs_gpu_kernels(hidden_states)
        act = carve(workspace2, (rows, moe.intermediate_size), dtype)
        if self.decodes(hidden_states, topk_ids.shape[1]):
            moe_decode(
                hidden_states,
                topk_ids,
                topk_weights,
                self.w13,
                None,
                self.w2,
                None,
                expert_map,
                moe.activation,
                act,
                output,
            )
            return
        scratch = self.permute_scratch(hidden_states.device)
        offsets, inv = moe_prepare_scatter(topk_ids, expert_map, scratch)
        gated = grouped_gemm_gated if kernels else grouped_gemm_gated_reference
        gemm = grouped_gemm if kernels else grouped_gemm_reference
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
