import pytest

from llmserve.core.block_pool import BlockPool, NoFreeBlocksError


def test_allocate_takes_blocks_in_free_queue_order_with_ref_count_one():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.ref_counts == [1, 1, 0, 0]
    assert pool.num_free_blocks == 2
    pool.check_integrity()


def test_allocate_beyond_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_freed_blocks_join_the_tail_and_shared_blocks_stay_until_last_reference():
    pool = BlockPool(4)
    blocks = pool.allocate(3)  # [0, 1, 2]; free queue [3]
    pool.incref([blocks[0]])
    pool.free(reversed(blocks))  # 2 then 1 freed; 0 still shared
    assert pool.ref_counts == [1, 0, 0, 0]
    assert pool.allocate(3) == [3, 2, 1]
    pool.free([0])
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_incref_of_a_free_block_revives_it_from_the_middle_of_the_queue():
    pool = BlockPool(3)
    pool.incref([1])
    assert pool.ref_counts == [0, 1, 0]
    assert pool.allocate(2) == [0, 2]
    pool.check_integrity()


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError):
        pool.free([block])


def test_usage_fraction():
    pool = BlockPool(4)
    pool.allocate(1)
    assert pool.usage == 0.25
