"""Routing on the wire: a token's top-k ids and weights as one int32 row.

Dispatch moves each token's routing with it. Packing ids (int32) and weights
(fp32, bit-cast) into one [T, 2 * topk] int32 tensor makes that one
collective instead of two.
"""

from __future__ import annotations

import torch


def pack_routing(topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """[T, 2 * topk] int32: ids, then the fp32 weights' bits."""
    return torch.cat([topk_ids.to(torch.int32), topk_weights.view(torch.int32)], dim=1)


def unpack_routing(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights fp32, topk_ids int32)``, contiguous, from
    :func:`pack_routing` rows."""
    topk = packed.shape[1] // 2
    ids, weights = packed.split(topk, dim=1)
    return weights.contiguous().view(torch.float32), ids.contiguous()
