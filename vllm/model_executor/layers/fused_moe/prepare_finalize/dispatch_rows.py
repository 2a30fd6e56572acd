"""A token's dispatch payload as one row of bytes.

Dispatch moves each token's top-k ids, top-k weights, activations and (for
prequantized schemes) activation scales to other ranks. Side by side in one
uint8 row they move in one collective instead of four: at decode sizes a
collective costs its latency, not its bytes. The ids come first, so that
padding rows (ids -1: routed nowhere) are a byte fill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DispatchRows:
    topk_ids: torch.Tensor  # int32 [T, topk]
    topk_weights: torch.Tensor  # fp32 [T, topk]
    a1q: torch.Tensor  # [T, H]
    a1q_scale: torch.Tensor | None  # fp32 [T, groups]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    rows, cols = t.shape
    return t.contiguous().view(torch.uint8).view(rows, cols * t.element_size())


@dataclass(frozen=True)
class DispatchLayout:
    """The byte layout of one token's row: ids (int32), weights (fp32),
    activations, scales (fp32, ``scale_groups`` of them; 0: none)."""

    topk: int
    hidden: int
    a1q_dtype: torch.dtype
    scale_groups: int

    @classmethod
    def of(
        cls, topk_ids: torch.Tensor, a1q: torch.Tensor, a1q_scale: torch.Tensor | None
    ) -> DispatchLayout:
        groups = 0 if a1q_scale is None else a1q_scale.shape[1]
        return cls(topk_ids.shape[1], a1q.shape[1], a1q.dtype, groups)

    def pack(
        self,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        a1q: torch.Tensor,
        a1q_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """uint8 [T, row bytes]."""
        parts = [topk_ids.to(torch.int32), topk_weights.float(), a1q]
        if a1q_scale is not None:
            parts.append(a1q_scale.float())
        return torch.cat([_as_bytes(t) for t in parts], dim=1)

    def padding(self, rows: int, device: torch.device) -> torch.Tensor:
        """``rows`` rows routed to no expert (ids -1), zero elsewhere."""
        pad = torch.zeros((rows, self._ends()[-1]), dtype=torch.uint8, device=device)
        pad[:, : 4 * self.topk] = 0xFF  # int32 -1
        return pad

    def unpack(self, packed: torch.Tensor) -> DispatchRows:
        """The tensors of :meth:`pack`'s rows (any number of them)."""
        ends = self._ends()
        dtypes = (torch.int32, torch.float32, self.a1q_dtype, torch.float32)
        ids, weights, a1q, scale = (
            packed[:, start:end].contiguous().view(dtype)
            for start, end, dtype in zip((0, *ends[:-1]), ends, dtypes, strict=True)
        )
        return DispatchRows(ids, weights, a1q, scale if self.scale_groups else None)

    def _ends(self) -> tuple[int, int, int, int]:
        """Where the ids, weights, activations and scales end in a row (the
        last: the row's width)."""
        ids = 4 * self.topk
        weights = 2 * ids
        a1q = weights + self.hidden * self.a1q_dtype.itemsize
        return ids, weights, a1q, a1q + 4 * self.scale_groups
