"""Top-k routing of tokens to experts."""

from __future__ import annotations

import torch

from vllm.model_executor.kernels.common.device_info import runs_gpu_kernels
from vllm.model_executor.kernels.common.topk_softmax import topk_softmax


def fused_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, then top-k (one Triton kernel on CUDA;
    plain PyTorch, the oracle, on CPU).

    Returns ``(topk_weights fp32 [T, topk], topk_ids int32 [T, topk])``; with
    ``renormalize`` the selected weights of each token sum to one.
    """
    if gating_output.dim() != 2 or gating_output.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"gating_output: expected [{hidden_states.shape[0]}, num_experts], got "
            f"{tuple(gating_output.shape)}"
        )
    if not 1 <= topk <= gating_output.shape[1]:
        raise ValueError(f"topk: expected 1..{gating_output.shape[1]}, got {topk}")
    if runs_gpu_kernels(gating_output) and gating_output.stride(1) == 1:
        return topk_softmax(gating_output, topk, renormalize)
    probs = torch.softmax(gating_output.float(), dim=-1)
    topk_weights, topk_ids = probs.topk(topk, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)
