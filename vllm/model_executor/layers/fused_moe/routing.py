"""Top-k routing of tokens to experts."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from vllm.model_executor.kernels.common.device_info import runs_gpu_kernels
from vllm.model_executor.kernels.common.pdl import pdl
from vllm.model_executor.kernels.common.rms_norm import rms_norm, rms_norm_reference
from vllm.model_executor.kernels.common.router_topk import (
    rms_norm_router_logits,
    rms_norm_router_topk,
    router_topk,
    router_topk_applies,
)
from vllm.model_executor.kernels.common.skinny_gemm import (
    skinny_gemm,
    skinny_gemm_applies,
)
from vllm.model_executor.kernels.common.topk_softmax import topk_softmax
from vllm.v1.worker.workspace import get_lock_buffer


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


def gated_topk(
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
    topk: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_topk` of the router's logits ``hidden_states @
    gate_weight.T`` (in the inputs' dtype). On a GPU at one token the GEMM
    and the routing are one kernel (``router_topk``), whose counter is a
    lock buffer of the workspace manager (per slot and stream); otherwise,
    where ``skinny_gemm`` applies (two tokens; one past ``router_topk``'s
    experts), the GEMM is ``skinny_gemm`` (cuBLAS runs a 128-row router on
    two thread blocks). The counter is taken at every size, so the warm-up at the
    token budget creates it before the lock."""
    if runs_gpu_kernels(hidden_states):
        counter = get_lock_buffer("router_topk", 1, hidden_states.device)
        rows, num_experts = hidden_states.shape[0], gate_weight.shape[0]
        if _router_fits(hidden_states, gate_weight) and router_topk_applies(
            rows, num_experts, hidden_states.dtype
        ):
            return router_topk(hidden_states, gate_weight, topk, renormalize, counter)
    logits = router_logits(hidden_states, gate_weight)
    return fused_topk(hidden_states, logits, topk, renormalize)


def router_logits(
    hidden_states: torch.Tensor, gate_weight: torch.Tensor
) -> torch.Tensor:
    """``hidden_states @ gate_weight.T`` in their dtype: ``skinny_gemm`` on a
    GPU where it applies, else ``F.linear``."""
    if runs_gpu_kernels(hidden_states) and _router_fits(hidden_states, gate_weight):
        (rows, hidden), num_experts = hidden_states.shape, gate_weight.shape[0]
        dtype, with_pdl = hidden_states.dtype, pdl(hidden_states.device)
        if skinny_gemm_applies(rows, num_experts, hidden, dtype, with_pdl):
            return skinny_gemm(hidden_states, gate_weight)
    return F.linear(hidden_states, gate_weight)


def _router_fits(hidden_states: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    """Whether the router's own kernels take these operands' layouts."""
    return (
        hidden_states.stride(-1) == gate_weight.stride(-1) == 1
        and gate_weight.dtype == hidden_states.dtype
        and gate_weight.device == hidden_states.device
    )


def rms_norm_gated_topk(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    topk: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gated_topk` of ``rms_norm(hidden_states + residual)``: ``(topk
    weights, topk ids, the normalized rows, hidden_states + residual)``. On
    a GPU at one token the add and the norm run inside the router's kernel
    (``rms_norm_router_topk``: a decoder layer's post-attention norm costs
    no launch); otherwise the norm's kernel (its reference on CPU) first."""
    if _norm_in_router(hidden_states, gate_weight):
        counter = get_lock_buffer("router_topk", 1, hidden_states.device)
        return rms_norm_router_topk(
            hidden_states, residual, norm_weight, eps, gate_weight, topk,
            renormalize, counter,
        )  # fmt: skip
    normed, total = _rms_norm(hidden_states, residual, norm_weight, eps)
    return (*gated_topk(normed, gate_weight, topk, renormalize), normed, total)


def rms_norm_gated_logits(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rms_norm_gated_topk` without the routing, for experts whose
    kernels route from the logits: ``(router logits, the normalized rows,
    hidden_states + residual)``; at one token on a GPU one launch
    (``rms_norm_router_logits``)."""
    if _norm_in_router(hidden_states, gate_weight):
        return rms_norm_router_logits(
            hidden_states, residual, norm_weight, eps, gate_weight
        )
    normed, total = _rms_norm(hidden_states, residual, norm_weight, eps)
    return router_logits(normed, gate_weight), normed, total


def _norm_in_router(hidden_states: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    """Whether the residual add and the norm run in the router's kernel."""
    return (
        runs_gpu_kernels(hidden_states)
        and _router_fits(hidden_states, gate_weight)
        and router_topk_applies(
            hidden_states.shape[0], gate_weight.shape[0], hidden_states.dtype
        )
    )


def _rms_norm(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    norm = rms_norm if runs_gpu_kernels(hidden_states) else rms_norm_reference
    normed, total = norm(hidden_states, norm_weight, eps, residual)
    assert total is not None
    return normed, total
