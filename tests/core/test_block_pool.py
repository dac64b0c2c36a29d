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


@pytest.mark.parametrize(
    "corrupt, named",
    [
        (lambda pool: pool.ref_counts.__setitem__(1, -1), "block 1: ref -1"),  # a negative count
        (lambda pool: pool.ref_counts.__setitem__(3, 1), "block 3: ref 1, free=True"),  # queued, yet held
        (lambda pool: pool.ref_counts.__setitem__(0, 0), "block 0: ref 0, free=False"),  # unheld, not queued
        (lambda pool: pool._free.pop(2), "block 2: ref 0, free=False"),  # lost from the queue
    ],
)
def test_integrity_check_names_the_first_block_whose_count_and_queue_disagree(corrupt, named):
    pool = BlockPool(5)
    pool.allocate(2)  # 0 and 1 held; 2, 3, 4 queued
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError, match=named):
        pool.check_integrity()


def test_integrity_check_of_a_pool_with_nothing_held_catches_a_count():
    pool = BlockPool(4)
    pool.check_integrity()
    pool.ref_counts[2] = 1  # still queued
    with pytest.raises(AssertionError, match="block 2: ref 1, free=True"):
        pool.check_integrity()


def test_freeing_a_negative_block_id_is_an_error():
    pool = BlockPool(3)
    pool.allocate(3)
    with pytest.raises(RuntimeError, match="block -1 is not a block of this pool"):
        pool.free([-1])  # as a list index, the last block
    assert pool.ref_counts == [1, 1, 1] and pool.num_free_blocks == 0


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


def test_a_pool_that_reuses_latest_touches_only_its_peak_in_use():
    """Swap space is mapped lazily: cycling through every block would fault all of it in over time."""
    fifo, lifo = BlockPool(8), BlockPool(8, reuse_latest=True)
    touched = {id(fifo): set(), id(lifo): set()}
    for _ in range(6):
        for pool in (fifo, lifo):
            blocks = pool.allocate(2)
            touched[id(pool)].update(blocks)
            pool.free(blocks)
            pool.check_integrity()
    assert len(touched[id(lifo)]) == 2
    assert len(touched[id(fifo)]) == 8


def test_the_kv_cache_managers_swap_pool_reuses_latest():
    from llmserve.core.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(4, block_size=4, enable_prefix_caching=False, num_swap_blocks=8)
    first = kv.swap_space.pool.allocate(2)
    kv.swap_space.pool.free(first)
    assert sorted(kv.swap_space.pool.allocate(2)) == sorted(first)
