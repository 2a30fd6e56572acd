"""Expert parallelism by all-gather and reduce-scatter (the default backend).

prepare: every rank gathers every rank's tokens with their routing (one
collective of :mod:`dispatch_rows`), each rank's block padded to the largest
count (padding rows carry expert id -1: the permute skips them). The counts
come from the step's :class:`~vllm.forward_context.DPMetadata` where the
ranks agreed on them before the step (the engine's steps: no host sync, so
a CUDA graph holds the whole layer), else from a count exchange first (one
host sync). The experts of a rank compute its local experts' routes of all
gathered tokens.
finalize: a reduce-scatter sums the ranks' partial outputs and hands each
rank the rows of its own tokens.

Every rank moves every token, so this is the simple, routing-independent
path; ``all2all`` sends a token only where its experts are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.distributed import GroupCoordinator
from vllm.forward_context import current_dp_metadata
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEPrepareAndFinalize,
    PrepareResult,
    quantize_input,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize.dispatch_rows import (
    DispatchLayout,
)


@dataclass
class AllGatherPrepareResult(PrepareResult):
    num_tokens: int  # this rank's tokens: the rows finalize returns


class MoEPrepareAndFinalizeAllGatherReduceScatter(
    FusedMoEPrepareAndFinalize[AllGatherPrepareResult]
):
    def __init__(self, group: GroupCoordinator) -> None:
        self.group = group

    def _rows_per_rank(self, num_tokens: int, device: torch.device) -> int:
        """The largest token count of the ranks: each rank's block size."""
        group, dp = self.group, current_dp_metadata()
        if dp is None:
            counts = group.all_gather(
                torch.tensor([num_tokens], dtype=torch.int64, device=device)
            )
            return int(counts.max())  # one host sync
        if len(dp.num_tokens_across_dp) != group.world_size or (
            dp.num_tokens_across_dp[group.rank_in_group] != num_tokens
        ):
            raise ValueError(
                f"dp_metadata: expected {group.world_size} token counts with "
                f"{num_tokens} (this layer's tokens) at rank "
                f"{group.rank_in_group} of the {group.name} group, got "
                f"{dp.num_tokens_across_dp}"
            )
        return dp.max_tokens

    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        quant_config: FusedMoEQuantConfig,
    ) -> AllGatherPrepareResult:
        group = self.group
        num_tokens = a1.shape[0]
        rows = self._rows_per_rank(num_tokens, a1.device)
        a1q, a1q_scale = quantize_input(a1, quant_config)
        layout = DispatchLayout.of(topk_ids, a1q, a1q_scale)
        packed = layout.pack(topk_ids, topk_weights, a1q, a1q_scale)
        if rows > num_tokens:
            padding = layout.padding(rows - num_tokens, a1.device)
            packed = torch.cat([packed, padding])
        gathered = layout.unpack(group.all_gather(packed))
        return AllGatherPrepareResult(
            a1q=gathered.a1q,
            a1q_scale=gathered.a1q_scale,
            topk_weights=gathered.topk_weights,
            topk_ids=gathered.topk_ids,
            capacity_tokens=rows * group.world_size,
            num_tokens=num_tokens,
        )

    def finalize(
        self, fused_out: torch.Tensor, prepared: AllGatherPrepareResult
    ) -> torch.Tensor:
        return self.group.reduce_scatter(fused_out)[: prepared.num_tokens]
