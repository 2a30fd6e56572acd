import pytest
import torch

from vllm.v1.core.block_pool import BlockPool


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
