"""Softmax over experts, top-k and renormalization in one kernel (Triton).

A MoE layer's routing in plain PyTorch is seven kernels (cast, softmax,
top-k's select and sort, sum, divide, id cast): some 20 us per layer at
decode sizes, more than the layer's expert GEMMs take at one token. One
program routes one token: the softmax in fp32 in registers, then ``k``
rounds of max-and-remove (ties go to the lower expert id).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_softmax_kernel(
    weights_ptr,  # [T, K] fp32
    ids_ptr,  # [T, K] int32
    logits_ptr,  # [T, E]
    num_experts,
    stride_logits,
    K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    x = tl.load(logits_ptr + t * stride_logits + e, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    # -1: below every probability; a NaN row (overflowed logits) still
    # yields ids in range, never a lane past the experts
    p = p / tl.sum(p, 0)
    p = tl.where(valid & (p == p), p, -1.0)
    k = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for i in tl.static_range(K):
        best = tl.max(p, 0)
        chosen = tl.minimum(tl.min(tl.where(p == best, e, BLOCK_E), 0), num_experts - 1)
        weights = tl.where(k == i, best, weights)
        ids = tl.where(k == i, chosen, ids)
        p = tl.where(e == chosen, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(weights_ptr + t * K + k, weights, mask=k < K)
    tl.store(ids_ptr + t * K + k, ids, mask=k < K)


def topk_softmax(
    gating_output: torch.Tensor, topk: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32 [T, topk], ids int32 [T, topk])`` of ``gating_output``
    [T, E] (unit stride over experts), largest first."""
    tokens, num_experts = gating_output.shape
    if gating_output.stride(1) != 1 or not 1 <= topk <= num_experts:
        raise ValueError(
            f"gating_output/topk: expected unit stride over experts and topk in "
            f"1..{num_experts}, got strides {gating_output.stride()} and {topk}"
        )
    device = gating_output.device
    weights = torch.empty(tokens, topk, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, topk, dtype=torch.int32, device=device)
    if tokens:
        _topk_softmax_kernel[(tokens,)](
            weights,
            ids,
            gating_output,
            num_experts,
            gating_output.stride(0),
            K=topk,
            RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(topk),
        )
    return weights, ids
