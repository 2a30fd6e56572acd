"""Paged attention in plain PyTorch: the CPU path and the oracle of the GPU
backends.

One step's batch holds, per request, its new tokens (a prefill chunk or one
decode token) back to back. Each layer writes the new keys and values into
its cache at ``slot_mapping`` and then attends, per request, from each new
token to the request's cached tokens up to its own position (causal).
Cache layout per layer: [2 (k, v), num_blocks, block_size, kv_heads,
head_size].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.core.block_pool import BlockPool


@dataclass(frozen=True)
class PagedAttentionMetadata:
    query_lens: list[int]  # new tokens per request, in batch order
    seq_lens: list[int]  # the request's tokens in the cache after this step
    block_tables: list[torch.Tensor]  # per request: its block ids (int64)
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_size: int

    @classmethod
    def build(
        cls,
        pool: BlockPool,
        chunks: list[tuple[str, int, int]],
        device: torch.device | str,
    ) -> PagedAttentionMetadata:
        """For ``(request_id, start, end)`` chunks of tokens whose blocks the
        pool already holds (positions ``start:end`` of each request)."""
        return cls(
            query_lens=[end - start for _, start, end in chunks],
            seq_lens=[end for _, _, end in chunks],
            block_tables=[
                torch.tensor(pool.block_table(r), dtype=torch.int64, device=device)
                for r, _, _ in chunks
            ],
            slot_mapping=torch.cat(
                [pool.slots(r, start, end) for r, start, end in chunks]
            ).to(device),
            block_size=pool.block_size,
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


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store the step's ``k``/``v`` [T, kv_heads, d] in ``kv_cache`` and
    attend from ``q`` [T, heads, d]; returns [T, heads * d]."""
    kv_heads, head_size = k.shape[1], k.shape[2]
    keys = kv_cache[0].view(-1, kv_heads, head_size)
    values = kv_cache[1].view(-1, kv_heads, head_size)
    keys.index_copy_(0, meta.slot_mapping, k)
    values.index_copy_(0, meta.slot_mapping, v)
    out = q.new_empty(q.shape[0], q.shape[1] * head_size)
    start = 0
    offsets = torch.arange(meta.block_size, device=q.device)
    for query_len, seq_len, table in zip(
        meta.query_lens, meta.seq_lens, meta.block_tables, strict=True
    ):
        slots = (table[:, None] * meta.block_size + offsets).flatten()[:seq_len]
        rows = slice(start, start + query_len)
        out[rows] = attend(
            q[rows], keys[slots], values[slots], scale, seq_len - query_len
        )
        start += query_len
    return out
