"""The KV cache's blocks: a pool of fixed-size blocks and each request's
table of them.

A block holds ``block_size`` consecutive tokens of one request; token ``i``
of a request lives in slot ``table[i // block_size] * block_size +
i % block_size`` of every layer's cache. The pool is sized once (after the
profile run) and never grows: a request that needs a block when none is
free gets None and the scheduler preempts someone.
"""

from __future__ import annotations

from collections import deque

import torch


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks/block_size: expected >= 1, got {num_blocks}/{block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks ``request_id`` needs to hold ``num_tokens`` tokens."""
        have = len(self.block_table(request_id))
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold ``num_tokens`` tokens; None (and
        nothing taken) when the pool lacks the blocks."""
        needed = self.blocks_needed(request_id, num_tokens)
        if needed > len(self._free):
            return None
        table = self._tables.setdefault(request_id, [])
        table.extend(self._free.popleft() for _ in range(needed))
        return table

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool (finish, abort,
        preemption)."""
        self._free.extend(self._tables.pop(request_id, []))

    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Cache slots of the request's tokens ``start:end`` (int64)."""
        table = torch.tensor(self.block_table(request_id), dtype=torch.int64)
        positions = torch.arange(start, end)
        if end > len(table) * self.block_size:
            raise ValueError(
                f"end: request {request_id!r} holds {len(table) * self.block_size} "
                f"token slots, got {end}"
            )
        return table[positions // self.block_size] * self.block_size + (
            positions % self.block_size
        )
