import torch

from vllm.v1.attention.backends.torch_paged import (
    PagedAttentionMetadata,
    attend,
    paged_attention,
    write_kv_cache,
)
from vllm.v1.core.block_pool import BlockPool


def test_mixed_batch_equals_each_sequence_alone():
    """A prefill chunk continuing a cached prefix, a whole prefill and a
    decode token in one batch, each against attention over its full
    sequence."""
    torch.manual_seed(0)
    heads, kv_heads, d, bs = 4, 2, 8, 4
    lens = {"a": 10, "b": 6, "c": 13}
    seqs = {
        r: [
            torch.randn(n, heads, d),
            torch.randn(n, kv_heads, d),
            torch.randn(n, kv_heads, d),
        ]
        for r, n in lens.items()
    }
    pool = BlockPool(num_blocks=12, block_size=bs)
    cache = torch.full((2, 12, bs, kv_heads, d), float("nan"))  # unwritten: never read
    for r in ("c", "a", "b"):  # interleaved tables
        pool.allocate(r, lens[r])
    # Earlier steps: a's first 7 tokens, c's first 12.
    first = [("a", 0, 7), ("c", 0, 12)]
    step = [("a", 7, 10), ("b", 0, 6), ("c", 12, 13)]
    for chunks in (first, step):
        meta = PagedAttentionMetadata.build(pool, chunks, "cpu")
        q, k, v = (torch.cat([seqs[r][i][s:e] for r, s, e in chunks]) for i in range(3))
        write_kv_cache(cache, k, v, meta.slot_mapping)
        out = paged_attention(q, cache, meta, d**-0.5)
    start = 0
    for r, s, e in step:
        q, k, v = seqs[r]
        ref = attend(q, k, v, d**-0.5, 0)[s:e]
        torch.testing.assert_close(out[start : start + e - s], ref)
        start += e - s


def test_attend_is_causal_with_an_offset():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 2, 4), torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    out = attend(q, k, v, 0.5, 3)  # queries at positions 3 and 4
    full = attend(torch.cat([torch.randn(3, 2, 4), q]), k, v, 0.5, 0)
    torch.testing.assert_close(out, full[3:])
