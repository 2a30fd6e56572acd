"""The plain-PyTorch oracle of :mod:`.moe_decode`'s uint4 decode kernels
(fp32 math on the dequantized weights): the tests' reference, with the same
argument checks as the kernels."""

from __future__ import annotations

import torch

from vllm.model_executor.kernels.common.activation_quant import gated_act_reference
from vllm.model_executor.kernels.common.topk_softmax import top_routes_reference
from vllm.model_executor.kernels.grouped_gemm.w4a8 import dequantize_w4
from vllm.model_executor.kernels.marlin.moe_decode import (
    check_decode_args,
    check_decode_routing,
)
from vllm.model_executor.kernels.marlin.packing import dequantize_weights


def marlin_moe_decode_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    expert_map: torch.Tensor | None,
    activation: str,
    group_size: int,
    act: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`marlin_moe_decode` in plain PyTorch (fp32 math on the
    dequantized weights; ``act`` untouched)."""
    check_decode_routing(x, topk_ids, topk_weights)
    check_decode_args(x, topk_ids.shape[1], w13, w13_scales, w2, w2_scales, expert_map,
           activation, group_size, act, out)  # fmt: skip
    ids = topk_ids.long()
    num_ids = len(w13) if expert_map is None else len(expert_map)
    valid = (ids >= 0) & (ids < num_ids)
    if expert_map is not None:
        ids = torch.where(valid, expert_map.long()[ids.clamp(0, num_ids - 1)], -1)
        valid = ids >= 0
    result = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for t, k in valid.nonzero().tolist():
        e = int(ids[t, k])
        gate_up = _dequantize(w13[e], w13_scales[e], group_size)
        if w13.dtype == torch.uint8:  # W4A8's rows: gate 0, up 0, gate 1, ...
            gate_up = torch.cat([gate_up[0::2], gate_up[1::2]])
        h = gated_act_reference(activation, gate_up @ x[t].float())
        h = h.to(x.dtype).float()  # act is stored in the input dtype
        w_down = _dequantize(w2[e], w2_scales[e], group_size)
        result[t] += topk_weights[t, k] * (w_down @ h)
    return out.copy_(result)


def _dequantize(
    packed: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """fp32 [N, K] of one expert's weights in either packing."""
    if packed.dtype == torch.uint8:
        return dequantize_w4(packed, scales)
    return dequantize_weights(packed, scales.float(), group_size)


def marlin_moe_decode_routed_reference(
    x: torch.Tensor,
    logits: torch.Tensor,
    topk: int,
    renormalize: bool,
    w13: torch.Tensor,
    w13_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    expert_map: torch.Tensor | None,
    activation: str,
    group_size: int,
    act: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`marlin_moe_decode_routed` in plain PyTorch."""
    weights, ids = top_routes_reference(logits, topk, renormalize)
    return marlin_moe_decode_reference(
        x, ids, weights, w13, w13_scales, w2, w2_scales, expert_map, activation,
        group_size, act, out,
    )  # fmt: skip
