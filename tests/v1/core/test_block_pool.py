import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import Request


def test_tables_grow_by_whole_blocks_and_free_returns_them():
    pool = BlockPool(num_blocks=5, block_size=4)
    assert pool.allocate("a", 5) == [0, 1]  # 5 tokens: 2 blocks
    assert pool.allocate("a", 8) == [0, 1]  # still fits
    assert pool.allocate("b", 9) == [2, 3, 4]
    assert pool.num_free_blocks == 0
    assert pool.allocate("a", 9) is None  # no block left: nothing taken
    assert pool.block_table("a") == [0, 1] and pool.num_free_blocks == 0
    pool.free("b")
    assert pool.num_free_blocks == 3
    assert pool.allocate("a", 9) == [0, 1, 2]
    pool.free("never-seen")  # freeing an unknown request is a no-op
    assert pool.num_free_blocks == 2


def test_slots_follow_the_table():
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.allocate("x", 2)
    pool.allocate("a", 7)  # blocks 1 and 2
    assert pool.slots("a", 2, 7).tolist() == [6, 7, 8, 9, 10]
    with pytest.raises(ValueError, match="holds 8 token slots, got 9"):
        pool.slots("a", 0, 9)
    with pytest.raises(ValueError, match="num_blocks/block_size"):
        BlockPool(0, 16)
    assert pool.slots("a", 3, 3).dtype == torch.int64


# -- prefix caching ------------------------------------------------------------


def request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4))


def computed(pool: BlockPool, req: Request, cached: list[int] | None = None) -> None:
    """Allocate the request's whole prompt after ``cached`` and register it."""
    assert pool.allocate(req.request_id, req.num_tokens, cached) is not None
    pool.cache_blocks(req, req.num_tokens)


def test_a_prefix_is_shared_block_by_block_and_outlives_its_requests():
    pool = BlockPool(num_blocks=8, block_size=4, enable_caching=True)
    a = request("a", list(range(10)))  # two full blocks and a partial one
    computed(pool, a)
    same_start = request("b", [*range(8), 50, 51, 52, 53])
    hit = pool.cached_prefix(same_start)
    assert hit == pool.block_table("a")[:2]  # the partial block is never shared
    computed(pool, same_start, hit)
    assert pool.block_table("b")[:2] == hit and pool.num_free_blocks == 4
    pool.free("a")  # b still holds the shared blocks; a's third is free
    assert pool.num_free_blocks == 5
    pool.free("b")
    assert pool.num_free_blocks == 8
    # Nobody holds them, and they are still cached, with b's own third block.
    again = request("c", [*range(8), 50, 51, 52, 53, 9])
    assert pool.cached_prefix(again) == [*hit, pool_block_of(pool, again, 2)]


def pool_block_of(pool: BlockPool, req: Request, index: int) -> int:
    """The block cached for ``req``'s block ``index`` (its prefix cached)."""
    return pool._cached[pool._block_hashes(req, index + 1)[index]]


def test_a_block_hits_only_after_an_equal_prefix_and_before_the_last_token():
    pool = BlockPool(num_blocks=8, block_size=4, enable_caching=True)
    computed(pool, request("a", list(range(12))))
    # Block 1's tokens equal a's, block 0's differ: nothing is shared.
    assert pool.cached_prefix(request("b", [99, 1, 2, 3, *range(4, 12)])) == []
    # The same 12 tokens: the last token's logits must be computed, so the
    # last block is not taken even though it is cached.
    assert len(pool.cached_prefix(request("c", list(range(12))))) == 2
    assert len(pool.cached_prefix(request("d", list(range(13))))) == 3


def test_eviction_takes_uncached_blocks_first_then_the_least_recently_freed():
    pool = BlockPool(num_blocks=4, block_size=4, enable_caching=True)
    old, new = request("old", list(range(8))), request("new", list(range(20, 28)))
    computed(pool, old)
    computed(pool, new)
    assert pool.block_table("old") == [0, 1] and pool.block_table("new") == [2, 3]
    pool.free("old")
    pool.free("new")
    assert pool.allocate("x", 3) == [1]  # old's last block: evicted
    assert pool.cached_prefix(request("o", list(range(9)))) == [0]
    assert pool.cached_prefix(request("n", list(range(20, 29)))) == [2, 3]
    pool.free("x")  # an uncached block goes back first in line
    assert pool.allocate("y", 3) == [1]
    assert pool.cached_prefix(request("o", list(range(9)))) == [0]


def test_a_reallocated_block_is_never_found_with_its_old_tokens():
    pool = BlockPool(num_blocks=2, block_size=4, enable_caching=True)
    computed(pool, request("a", list(range(8))))
    pool.free("a")
    computed(pool, request("b", list(range(30, 38))))  # overwrites both
    assert pool.cached_prefix(request("c", list(range(9)))) == []
    assert len(pool._cached) == 2  # b's two blocks, a's forgotten


def test_the_cached_prefix_counts_against_the_free_blocks():
    pool = BlockPool(num_blocks=3, block_size=4, enable_caching=True)
    computed(pool, request("a", list(range(8))))
    pool.free("a")
    long = request("b", list(range(17)))  # 2 cached + 3 new blocks: too many
    hit = pool.cached_prefix(long)
    assert len(hit) == 2
    assert pool.allocate("b", 17, hit) is None
    assert pool.num_free_blocks == 3 and pool.cached_prefix(long) == hit
    assert pool.allocate("b", 12, hit) == [*hit, pool.block_table("b")[2]]
    with pytest.raises(ValueError, match="cached: request 'b' already holds blocks"):
        pool.allocate("b", 16, hit)


def test_only_known_tokens_are_registered_and_nothing_without_caching():
    pool = BlockPool(num_blocks=4, block_size=4, enable_caching=True)
    pending = request("a", list(range(7)))
    pending.num_pending_tokens = 1  # token 7 is still on the device
    assert pool.allocate("a", 8) is not None
    pool.cache_blocks(pending, 8)  # block 1 is full, but not known yet
    assert len(pool._cached) == 1
    pending.num_pending_tokens = 0
    pending.output_token_ids.append(7)
    pool.cache_blocks(pending, 8)
    assert len(pool.cached_prefix(request("b", list(range(9))))) == 2
    plain = BlockPool(num_blocks=4, block_size=4)
    computed(plain, request("a", list(range(8))))
    assert plain.cached_prefix(request("b", list(range(9)))) == []
