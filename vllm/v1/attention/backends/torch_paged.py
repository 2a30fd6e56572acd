"""Paged attention in plain PyTorch: the CPU path and the oracle of the GPU
backends.

One step's batch holds, per request, its new tokens (a prefill chunk or one
decode token) back to back. Each layer writes the new keys and values into
its cache at ``slot_mapping`` (``write_kv_cache``, shared by the backends)
and then attends, per request, from each new token to the request's cached
tokens up to its own position (causal).
Cache layout per layer: [2 (k, v), num_blocks, block_size, kv_heads,
head_size].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.core.block_pool import BlockPool


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """One step's batch: requests in batch order, each with its new tokens
    (rows ``query_start_loc[i]:query_start_loc[i + 1]``)."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: the request's cached tokens after the step
    block_table: torch.Tensor  # [>= B, max_blocks] int32; unused tails any value
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_size: int
    max_query_len: int  # host-side bound on any request's new tokens

    @classmethod
    def build(
        cls,
        pool: BlockPool,
        chunks: list[tuple[str, int, int]],
        device: torch.device | str,
    ) -> PagedAttentionMetadata:
        """For ``(request_id, start, end)`` chunks of tokens whose blocks the
        pool already holds (positions ``start:end`` of each request)."""
        tables = [pool.block_table(r) for r, _, _ in chunks]
        block_table = torch.zeros(
            len(chunks), max(map(len, tables), default=0), dtype=torch.int32
        )
        for row, table in zip(block_table, tables, strict=True):
            row[: len(table)] = torch.tensor(table, dtype=torch.int32)
        query_lens = torch.tensor([end - start for _, start, end in chunks])
        return cls(
            query_start_loc=torch.cat([torch.zeros(1), query_lens.cumsum(0)])
            .to(torch.int32)
            .to(device),
            seq_lens=torch.tensor([e for _, _, e in chunks], dtype=torch.int32).to(
                device
            ),
            block_table=block_table.to(device),
            slot_mapping=torch.cat(
                [pool.slots(r, start, end) for r, start, end in chunks]
            ).to(device),
            block_size=pool.block_size,
            max_query_len=int(query_lens.max()) if chunks else 0,
        )


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int
) -> torch.Tensor:
    """``q`` [Q, heads, d] at positions ``offset + i`` attending causally to
    ``k``/``v`` [L, kv_heads, d] at positions 0..L-1; returns [Q, heads * d].
    Scores in the activations' dtype, softmax in fp32 (as ``transformers``'
    eager attention)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    query_pos = offset + torch.arange(q.shape[0], device=q.device)
    future = torch.arange(k.shape[0], device=q.device)[None, :] > query_pos[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(q.shape[0], -1)


def write_kv_cache(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store the step's ``k``/``v`` [T, kv_heads, d] at cache ``slots`` [T]
    (every backend's first half)."""
    kv_heads, head_size = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, kv_heads, head_size).index_copy_(0, slots, k)
    kv_cache[1].view(-1, kv_heads, head_size).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attend from ``q`` [T, heads, d] to each request's cached tokens (the
    step's own already written); returns [T, heads * d]."""
    kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    keys = kv_cache[0].view(-1, kv_heads, head_size)
    values = kv_cache[1].view(-1, kv_heads, head_size)
    out = q.new_empty(q.shape[0], q.shape[1] * head_size)
    bounds = meta.query_start_loc.tolist()
    offsets = torch.arange(meta.block_size, device=q.device)
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        blocks = meta.block_table[i, : -(-seq_len // meta.block_size)].long()
        slots = (blocks[:, None] * meta.block_size + offsets).flatten()[:seq_len]
        start, end = bounds[i], bounds[i + 1]
        out[start:end] = attend(
            q[start:end], keys[slots], values[slots], scale, seq_len - (end - start)
        )
    return out
