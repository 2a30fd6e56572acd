"""The KV cache's blocks: a pool of fixed-size blocks, each request's table
of them, and the prefix cache over them.

A block holds ``block_size`` consecutive tokens of one request; token ``i``
of a request lives in slot ``table[i // block_size] * block_size +
i % block_size`` of every layer's cache. The pool is sized once (after the
profile run) and never grows: a request that needs a block when none is
free gets None and the scheduler preempts someone.

Prefix caching (vLLM's automatic prefix caching): a full block whose tokens
are known is registered under a hash of its tokens and of every token
before it (SHA-256, chained block to block: equal hashes mean equal
prefixes, so equal keys and values). A new request takes the cached blocks
of its longest registered prefix instead of computing them; blocks are
reference counted, and a block no request holds stays cached while it sits
in the free list, until it is allocated again (least recently freed
first; uncached blocks are handed out before any cached one). Only full
blocks are shared and a request never writes to a block it did not
allocate: its computation starts after its cached blocks.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import torch

from vllm.v1.request import Request


def hash_block_tokens(parent: bytes, token_ids: np.ndarray) -> bytes:
    """The hash of a block holding ``token_ids`` (int64) after the prefix
    whose last block hashed to ``parent`` (``b""`` for the first block)."""
    hasher = hashlib.sha256(parent)
    hasher.update(token_ids.data)
    return hasher.digest()


class BlockPool:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = False
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks/block_size: expected >= 1, got {num_blocks}/{block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching = enable_caching
        # Allocation order: the first key goes first (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._cached: dict[bytes, int] = {}  # block hash -> block
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._num_registered: dict[str, int] = {}  # table entries looked at

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are reused
        when the uncached run out)."""
        return len(self._free)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def allocate(
        self, request_id: str, num_tokens: int, cached: list[int] | None = None
    ) -> list[int] | None:
        """Grow the request's table to hold ``num_tokens`` tokens, starting a
        new table with the ``cached`` blocks (from :meth:`cached_prefix`);
        None (and nothing taken) when the pool lacks the blocks."""
        table, prefix = self._tables.get(request_id), cached or []
        if prefix and table is not None:
            raise ValueError(
                f"cached: request {request_id!r} already holds blocks; a cached "
                "prefix only starts a table"
            )
        needed = -(-num_tokens // self.block_size) - len(table or prefix)
        if needed > 0 or prefix:  # (a decode step mostly needs nothing)
            # the prefix's unheld blocks leave the free list too
            unheld = sum(self._refs[block] == 0 for block in prefix)
            if needed > len(self._free) - unheld:
                return None
        if table is None:
            table = self._tables[request_id] = []
        for block in prefix:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        table += prefix
        for _ in range(needed):
            table.append(self._pop_free())
        return table

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        if (block_hash := self._block_hash[block]) is not None:  # evicted
            del self._cached[block_hash]
            self._block_hash[block] = None
        self._refs[block] = 1
        return block

    def free(self, request_id: str) -> None:
        """Release the request's blocks (finish, abort, preemption): the
        blocks no other request holds return to the free list, its last
        blocks first (a prefix's tail is the least likely to be shared)."""
        self._num_registered.pop(request_id, None)
        for block in reversed(self._tables.pop(request_id, [])):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if self._block_hash[block] is None:  # reused before cached ones
                    self._free.move_to_end(block, last=False)

    # -- prefix caching ------------------------------------------------------

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's block hashes (kept on it), at least its first
        ``num_blocks`` (their tokens known)."""
        hashes, size, prompt = (
            request.block_hashes,
            self.block_size,
            request.prompt_array,
        )
        for i in range(len(hashes), num_blocks):
            start, end = i * size, (i + 1) * size
            if end <= len(prompt):
                tokens = prompt[start:end]
            else:
                tokens = np.asarray(request.token_ids(start, end), dtype=np.int64)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else b"", tokens))
        return hashes

    def cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks holding the request's longest registered prefix, short
        of its last token (whose logits the request must compute); none
        without caching or once the request holds blocks."""
        if not self.enable_caching or request.request_id in self._tables:
            return []
        blocks = []
        limit = (request.num_known_tokens - 1) // self.block_size
        for block_hash in self._block_hashes(request, limit)[:limit]:
            if (block := self._cached.get(block_hash)) is None:
                break
            blocks.append(block)
        return blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """Register the request's full blocks among its first ``num_tokens``
        tokens (computed, or scheduled to be, before any later step reads
        them) whose tokens are known; returns the blocks registered now. A
        block whose prefix is already cached in another block stays
        unregistered."""
        if not self.enable_caching:
            return []
        request_id = request.request_id
        full = min(num_tokens, request.num_known_tokens) // self.block_size
        start = self._num_registered.get(request_id, 0)
        if full <= start:  # (a decode step, but one in block_size)
            return []
        table, hashes = self._tables[request_id], self._block_hashes(request, full)
        registered = []
        for i in range(start, full):
            block, block_hash = table[i], hashes[i]
            if self._block_hash[block] is None and block_hash not in self._cached:
                self._cached[block_hash] = block
                self._block_hash[block] = block_hash
                registered.append(block)
        self._num_registered[request_id] = full
        return registered

    # -- cache slots ---------------------------------------------------------

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
