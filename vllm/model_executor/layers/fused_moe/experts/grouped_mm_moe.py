"""Unquantized experts on ``torch._grouped_mm`` (CUDA) or a reference loop (CPU).

The baseline backend and the CPU path. Permuted activations and the
activation output live in the caller's workspaces; the GEMM outputs are
allocated by torch (its grouped GEMMs have no ``out=`` variant).
"""

from __future__ import annotations

import torch

from vllm.model_executor.kernels.common.device_info import runs_gpu_kernels
from vllm.model_executor.layers.fused_moe.activation import apply_moe_activation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.experts.unquantized import (
    UnquantizedExperts,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import carve
from vllm.model_executor.layers.fused_moe.moe_permute_unpermute import (
    moe_permute,
    moe_unpermute,
)


def grouped_mm_ends(expert_first_token_offset: torch.Tensor) -> torch.Tensor:
    """The ``offs`` of torch's grouped GEMMs: int32 cumulative row ends per
    expert. Computed once per layer call, shared by both GEMMs."""
    return expert_first_token_offset[1:].to(torch.int32)


def grouped_mm(
    a: torch.Tensor,
    w: torch.Tensor,
    expert_ends: torch.Tensor,
    scale_a: torch.Tensor | None = None,
    scale_w: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Rows of expert e (``ends[e-1]:ends[e]``) times ``w[e]^T``.

    ``a`` [R, K], ``w`` [E, N, K], ``expert_ends`` from
    :func:`grouped_mm_ends`; returns [R, N]. Rows at or past ``ends[-1]`` are
    left unspecified. With scales (fp8), ``scale_a`` [R] per row and
    ``scale_w`` [E, N] per output channel.
    """
    if runs_gpu_kernels(a):
        if scale_a is None:
            return torch._grouped_mm(
                a, w.transpose(1, 2), offs=expert_ends, out_dtype=out_dtype
            )
        assert scale_w is not None
        return torch._scaled_grouped_mm(
            a,
            w.transpose(1, 2),
            scale_a,
            scale_w,
            offs=expert_ends,
            out_dtype=out_dtype,
        )
    # CPU reference: one matmul per expert in fp32 (host sync is fine here).
    out = torch.zeros(a.shape[0], w.shape[1], dtype=out_dtype, device=a.device)
    bounds = [0, *expert_ends.tolist()]
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        rows, weight = a[lo:hi].float(), w[e].float()
        if scale_a is not None and scale_w is not None:
            rows = rows * scale_a[lo:hi, None]
            weight = weight * scale_w[e][:, None]
        out[lo:hi] = (rows @ weight.t()).to(out_dtype)
    return out


class GroupedMMExperts(UnquantizedExperts):
    """bf16/fp16 experts: permute -> GEMM1 -> activation -> GEMM2 -> unpermute."""

    def __init__(
        self, moe: FusedMoEConfig, w13: torch.Tensor, w2: torch.Tensor
    ) -> None:
        super().__init__(moe, w13, w2)
        self.w13 = w13.contiguous()
        self.w2 = w2.contiguous()

    # float32 runs the CPU loop only (torch._grouped_mm takes 16-bit operands).
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)

    @classmethod
    def unsupported(cls, moe: FusedMoEConfig, device: torch.device) -> str | None:
        reason = super().unsupported(moe, device)
        if reason is not None or device.type != "cuda":
            return reason
        if moe.in_dtype == torch.float32:
            return "moe.in_dtype: torch._grouped_mm takes bf16/fp16 on CUDA, got fp32"
        if moe.hidden_size % 8 or moe.intermediate_size % 8:
            return (
                "hidden_size/intermediate_size: torch._grouped_mm needs "
                f"multiples of 8, got {moe.hidden_size}/{moe.intermediate_size}"
            )
        return None

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
        a_perm = carve(workspace13, (rows, moe.hidden_size), dtype)
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
        ends = grouped_mm_ends(offsets)
        gate_up = grouped_mm(a_perm, self.w13, ends, out_dtype=dtype)
        act = carve(workspace2, (rows, moe.intermediate_size), dtype)
        apply_moe_activation(moe.activation, act, gate_up)
        down = grouped_mm(act, self.w2, ends, out_dtype=dtype)
        moe_unpermute(output, down, topk_weights, inv, offsets)
