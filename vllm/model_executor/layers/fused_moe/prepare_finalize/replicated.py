"""Expert parallelism over ranks that hold the same tokens (tensor
parallelism: every rank of the group runs the whole batch).

prepare: nothing moves; each rank's experts compute their routes of all
tokens (routes to other ranks' experts are never written).
finalize: an all-reduce sums the ranks' partial outputs.
"""

from __future__ import annotations

import torch

from vllm.distributed import GroupCoordinator
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    MoEPrepareAndFinalizeNoEP,
    PrepareResult,
)


class MoEPrepareAndFinalizeReplicated(MoEPrepareAndFinalizeNoEP):
    def __init__(self, group: GroupCoordinator) -> None:
        self.group = group

    def finalize(
        self, fused_out: torch.Tensor, prepared: PrepareResult
    ) -> torch.Tensor:
        return self.group.all_reduce(fused_out)
