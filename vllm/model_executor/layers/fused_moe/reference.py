"""A dense float64 MoE: the oracle of the experts backends (tests, checks).

Every expert of every token's routes computed one by one in float64 on the
CPU from dequantized weights; no permute, no kernels.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.activation import apply_moe_activation


def fused_moe_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    activation: str = "silu",
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * W2[e] act(W13[e] x[t]) over local experts e.

    ``w13`` [E_local, 2I, K] and ``w2`` [E_local, K, I] are dequantized weights;
    routes to non-local or invalid experts contribute nothing.
    """
    x = hidden_states.double().cpu()
    w13, w2 = w13.double().cpu(), w2.double().cpu()
    ids = topk_ids.long().cpu()
    weights = topk_weights.double().cpu()
    num_experts = len(expert_map) if expert_map is not None else w13.shape[0]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for e in range(num_experts):
        local = e if expert_map is None else int(expert_map[e])
        if local < 0:
            continue
        routed = ids == e  # [T, topk]
        tokens = routed.any(dim=1)
        if not bool(tokens.any()):
            continue
        gate_up = x[tokens] @ w13[local].t()
        act = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=torch.float64)
        apply_moe_activation(activation, act, gate_up)
        weight = (weights * routed).sum(dim=1)[tokens]
        out[tokens] += weight[:, None] * (act @ w2[local].t())
    return out
