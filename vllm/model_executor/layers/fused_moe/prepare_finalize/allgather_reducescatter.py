"""Expert parallelism by all-gather and reduce-scatter (the default backend).

prepare: the ranks exchange their token counts, then every rank gathers every
rank's tokens and routing, each rank's block padded to the largest count
(padding rows carry expert id -1: the permute skips them). The experts of a
rank compute its local experts' routes of all gathered tokens.
finalize: a reduce-scatter sums the ranks' partial outputs and hands each
rank the rows of its own tokens.

Every rank moves every token, so this is the simple, routing-independent
path; ``all2all`` sends a token only where its experts are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.distributed import GroupCoordinator
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEPrepareAndFinalize,
    PrepareResult,
    quantize_input,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize.routing_rows import (
    pack_routing,
    unpack_routing,
)


@dataclass
class AllGatherPrepareResult(PrepareResult):
    num_tokens: int  # this rank's tokens: the rows finalize returns


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with rows appended up to ``rows`` (their contents unused)."""
    if t.shape[0] == rows:
        return t
    padded = t.new_empty((rows, *t.shape[1:]))
    padded[: t.shape[0]] = t
    return padded


class MoEPrepareAndFinalizeAllGatherReduceScatter(
    FusedMoEPrepareAndFinalize[AllGatherPrepareResult]
):
    def __init__(self, group: GroupCoordinator) -> None:
        self.group = group

    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        quant_config: FusedMoEQuantConfig,
    ) -> AllGatherPrepareResult:
        group = self.group
        num_tokens = a1.shape[0]
        counts = group.all_gather(
            torch.tensor([num_tokens], dtype=torch.int64, device=a1.device)
        )
        rows = int(counts.max())  # one host sync: the padded block size
        a1q, a1q_scale = quantize_input(a1, quant_config)
        topk = topk_ids.shape[1]
        routing = torch.zeros((rows, 2 * topk), dtype=torch.int32, device=a1.device)
        routing[num_tokens:, :topk] = -1  # padding: no expert, weight 0
        routing[:num_tokens] = pack_routing(topk_weights, topk_ids)
        weights, ids = unpack_routing(group.all_gather(routing))
        return AllGatherPrepareResult(
            a1q=group.all_gather(_pad_rows(a1q, rows)),
            a1q_scale=(
                None
                if a1q_scale is None
                else group.all_gather(_pad_rows(a1q_scale, rows))
            ),
            topk_weights=weights,
            topk_ids=ids,
            capacity_tokens=rows * group.world_size,
            num_tokens=num_tokens,
        )

    def finalize(
        self, fused_out: torch.Tensor, prepared: AllGatherPrepareResult
    ) -> torch.Tensor:
        return self.group.reduce_scatter(fused_out)[: prepared.num_tokens]
