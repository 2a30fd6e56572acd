"""Which expert-parallel rank owns which experts: linear placement.

vLLM's default: every rank owns one contiguous range of global expert ids;
with E experts on N ranks each rank gets E // N of them and the first E % N
ranks one more. The expert map (global id -> local id, -1 where another rank
owns the expert) is the contiguous int32 tensor the permute path takes;
routes to experts mapped to -1 contribute nothing on this rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    num_experts: int
    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts: expected >= 1, got {self.num_experts}")
        if not 1 <= self.ep_size <= self.num_experts:
            # A rank without experts would have nothing to compute.
            raise ValueError(
                f"ep_size: expected 1..num_experts={self.num_experts}, got "
                f"{self.ep_size}"
            )
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(
                f"ep_rank: expected 0..{self.ep_size - 1}, got {self.ep_rank}"
            )

    def num_experts_of(self, rank: int) -> int:
        base, extra = divmod(self.num_experts, self.ep_size)
        return base + (rank < extra)

    def first_expert_of(self, rank: int) -> int:
        base, extra = divmod(self.num_experts, self.ep_size)
        return rank * base + min(rank, extra)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts_of(self.ep_rank)

    @property
    def local_experts(self) -> range:
        """Global ids of this rank's experts (local id = position in it)."""
        first = self.first_expert_of(self.ep_rank)
        return range(first, first + self.num_local_experts)

    def expert_map(self, device: torch.device | str) -> torch.Tensor | None:
        """int32 [num_experts]: global id -> local id, -1 on other ranks'
        experts; None without expert parallelism (every expert is local)."""
        if self.ep_size == 1:
            return None
        expert_map = torch.full((self.num_experts,), -1, dtype=torch.int32)
        local = self.local_experts
        expert_map[local.start : local.stop] = torch.arange(
            len(local), dtype=torch.int32
        )
        return expert_map.to(device)

    def owner_map(self, device: torch.device | str) -> torch.Tensor:
        """int64 [num_experts]: the rank that owns each global expert."""
        counts = [self.num_experts_of(r) for r in range(self.ep_size)]
        return torch.repeat_interleave(
            torch.arange(self.ep_size), torch.tensor(counts)
        ).to(device)
