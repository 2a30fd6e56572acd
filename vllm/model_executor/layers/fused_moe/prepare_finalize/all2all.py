"""Expert parallelism by ``all_to_all_single``: a token goes only where its
experts are.

prepare: each token is sent once to every rank that owns at least one of its
routed experts, with its whole routing (the receiving rank's expert map drops
the routes it does not own). Split sizes, and each rank's token count, are
exchanged first in one small all-to-all; one host sync reads them. Each
sent row carries the token's routing, activations and scales in one
collective (:mod:`dispatch_rows`).
The experts of a rank then compute their routes of the tokens it received,
already weighted by the routing weights.
finalize: the partial outputs go back along the reverse splits and the
source rank sums each token's partials (one per rank it was sent to) in fp32.

Against ``allgather_reducescatter`` this moves a token to at most
min(top-k, ranks) ranks instead of to all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.distributed import GroupCoordinator
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.expert_placement import ExpertPlacement
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEPrepareAndFinalize,
    PrepareResult,
    quantize_input,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize.dispatch_rows import (
    DispatchLayout,
)


@dataclass
class All2AllPrepareResult(PrepareResult):
    num_tokens: int  # this rank's tokens: the rows finalize returns
    send_tokens: torch.Tensor  # token index of each sent row, grouped by rank
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank


class MoEPrepareAndFinalizeAll2All(FusedMoEPrepareAndFinalize[All2AllPrepareResult]):
    def __init__(
        self,
        group: GroupCoordinator,
        placement: ExpertPlacement,
        device: torch.device,
    ) -> None:
        if group.world_size != placement.ep_size:
            raise ValueError(
                f"placement: expected ep_size={group.world_size} (the "
                f"{group.name} group's size), got {placement.ep_size}"
            )
        self.group = group
        self.num_experts = placement.num_experts
        self.owner = placement.owner_map(device)

    def _destinations(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """bool [ranks, T]: whether token t has a route to rank r (invalid
        ids, < 0 or >= num_experts, go nowhere)."""
        ranks, num_experts = self.group.world_size, self.num_experts
        ids = topk_ids.long()
        valid = (ids >= 0) & (ids < num_experts)
        dest = torch.where(valid, self.owner[ids.clamp(0, num_experts - 1)], ranks)
        sends = torch.zeros(
            (topk_ids.shape[0], ranks + 1), dtype=torch.bool, device=ids.device
        )
        sends.scatter_(1, dest, True)
        return sends[:, :ranks].t()

    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        quant_config: FusedMoEQuantConfig,
    ) -> All2AllPrepareResult:
        group, ranks = self.group, self.group.world_size
        num_tokens = a1.shape[0]
        sends = self._destinations(topk_ids)
        # Row r: (rows for rank r, this rank's token count); the token counts
        # bound what any rank can receive (see PrepareResult.capacity_tokens).
        meta = torch.stack(
            [sends.sum(dim=1), torch.full((ranks,), num_tokens, device=a1.device)],
            dim=1,
        )
        recv_meta = torch.empty_like(meta)
        group.all_to_all_single(recv_meta, meta, [1] * ranks, [1] * ranks)
        send_splits, recv_splits, token_counts = (
            torch.cat([meta[:, 0], recv_meta.t().flatten()]).view(3, ranks).tolist()
        )
        send_tokens = sends.nonzero()[:, 1]  # ordered by rank, then token
        a1q, a1q_scale = quantize_input(a1, quant_config)
        layout = DispatchLayout.of(topk_ids, a1q, a1q_scale)
        packed = layout.pack(topk_ids, topk_weights, a1q, a1q_scale)
        received = packed.new_empty((sum(recv_splits), packed.shape[1]))
        group.all_to_all_single(
            received, packed.index_select(0, send_tokens), recv_splits, send_splits
        )
        rows = layout.unpack(received)
        return All2AllPrepareResult(
            a1q=rows.a1q,
            a1q_scale=rows.a1q_scale,
            topk_weights=rows.topk_weights,
            topk_ids=rows.topk_ids,
            capacity_tokens=sum(token_counts),
            num_tokens=num_tokens,
            send_tokens=send_tokens,
            send_splits=send_splits,
            recv_splits=recv_splits,
        )

    def finalize(
        self, fused_out: torch.Tensor, prepared: All2AllPrepareResult
    ) -> torch.Tensor:
        returned = fused_out.new_empty(
            (prepared.send_tokens.shape[0], fused_out.shape[1])
        )
        self.group.all_to_all_single(
            returned, fused_out, prepared.send_splits, prepared.recv_splits
        )
        out = torch.zeros(
            (prepared.num_tokens, fused_out.shape[1]),
            dtype=torch.float32,
            device=fused_out.device,
        )
        # One rank's rows name each token at most once: a plain indexed add
        # per rank, deterministic (no atomics racing on one row).
        for rows, tokens in zip(
            returned.split(prepared.send_splits),
            prepared.send_tokens.split(prepared.send_splits),
            strict=True,
        ):
            out[tokens] += rows.float()
        return out.to(fused_out.dtype)
