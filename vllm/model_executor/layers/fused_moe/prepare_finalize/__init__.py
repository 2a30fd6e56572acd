"""Prepare/finalize of the modular MoE kernel across expert-parallel ranks.

Backends by name (``all2all_backend``, as vLLM's ``--all2all-backend``):

- ``allgather_reducescatter`` (default): every rank gathers all tokens, runs
  its local experts, reduce-scatters the outputs;
- ``all2all``: each token goes only to the ranks owning its experts
  (``all_to_all_single``) and its partial outputs come back.

Ranks that hold the same tokens (tensor parallelism) exchange none:
``replicated`` sums their partial outputs. Without an expert-parallel group
the single-process
:class:`~vllm.model_executor.layers.fused_moe.modular_kernel.MoEPrepareAndFinalizeNoEP`
runs.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.distributed import GroupCoordinator
from vllm.model_executor.layers.fused_moe.expert_placement import ExpertPlacement
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEPrepareAndFinalize,
    MoEPrepareAndFinalizeNoEP,
)

from .all2all import MoEPrepareAndFinalizeAll2All
from .allgather_reducescatter import MoEPrepareAndFinalizeAllGatherReduceScatter
from .replicated import MoEPrepareAndFinalizeReplicated

ALL2ALL_BACKENDS = ("allgather_reducescatter", "all2all")


def check_all2all_backend(all2all_backend: str) -> None:
    if all2all_backend not in ALL2ALL_BACKENDS:
        raise ValueError(
            f"all2all_backend: expected one of {ALL2ALL_BACKENDS}, got "
            f"{all2all_backend!r}"
        )


def make_prepare_finalize(
    all2all_backend: str,
    ep_group: GroupCoordinator | None,
    placement: ExpertPlacement,
    device: torch.device,
    replicated_tokens: bool = False,
) -> FusedMoEPrepareAndFinalize[Any]:
    """The prepare/finalize of a layer with ``placement`` on ``device``;
    single-process without ``ep_group``; no exchange where every rank of
    the group holds the same tokens (``replicated_tokens``)."""
    check_all2all_backend(all2all_backend)
    if ep_group is None:
        return MoEPrepareAndFinalizeNoEP()
    if replicated_tokens:
        return MoEPrepareAndFinalizeReplicated(ep_group)
    if all2all_backend == "all2all":
        return MoEPrepareAndFinalizeAll2All(ep_group, placement, device)
    return MoEPrepareAndFinalizeAllGatherReduceScatter(ep_group)
