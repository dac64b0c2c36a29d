"""Automatic prefix caching: exact block ids, reference counts and LRU eviction order."""

from llmserve.config import SchedulerConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.prefix_cache import hash_block
from llmserve.core.scheduler import Scheduler
from llmserve.request import RequestStatus

from .test_scheduler import finish_step, plan_of

SHARED = list(range(100, 112))  # three full blocks of 4


def make_scheduler(num_blocks=16, budget=64, caching=True):
    kv = KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(budget, 8, 1000), kv), kv


def test_shared_prefix_hit_reuses_blocks_and_counts_references(make_request):
    scheduler, kv = make_scheduler()
    first = make_request(0, tokens=SHARED + [1, 2])
    scheduler.add_request(first)
    finish_step(scheduler, scheduler.schedule())
    assert kv.get_block_table(first.request_id) == [0, 1, 2, 3]

    second = make_request(0, tokens=SHARED + [7, 8, 9])
    scheduler.add_request(second)
    plan = scheduler.schedule()
    assert plan_of(plan) == [(first.request_id, 1), (second.request_id, 3)]  # 12 of 15 tokens cached
    assert second.num_computed_tokens == 12 and second.num_cached_tokens == 12
    assert kv.get_block_table(second.request_id) == [0, 1, 2, 4]
    assert kv.pool.ref_counts[:5] == [2, 2, 2, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (14 + 15, 12)
    kv.check_integrity()


def test_at_least_one_token_is_always_computed(make_request):
    scheduler, kv = make_scheduler()
    first = make_request(0, tokens=SHARED)
    scheduler.add_request(first)
    finish_step(scheduler, scheduler.schedule())
    twin = make_request(0, tokens=SHARED)
    scheduler.add_request(twin)
    plan = scheduler.schedule()
    assert plan_of(plan)[-1] == (twin.request_id, 4)  # blocks 0-1 hit; the last block is recomputed
    assert kv.get_block_table(twin.request_id)[:2] == [0, 1]


def test_freed_cached_blocks_stay_in_the_lru_queue_and_revive_on_a_hit(make_request):
    scheduler, kv = make_scheduler(num_blocks=8)
    first = make_request(0, tokens=SHARED + [1], max_tokens=1)
    scheduler.add_request(first)
    finish_step(scheduler, scheduler.schedule())
    assert first.status == RequestStatus.FINISHED_LENGTH
    assert kv.pool.num_free_blocks == 8 and kv.pool.num_cached_blocks == 3
    # freed last-first: free queue is [4, 5, 6, 7, 3, 2, 1, 0]; 0..2 still cached
    again = make_request(0, tokens=SHARED + [5, 6])
    scheduler.add_request(again)
    scheduler.schedule()
    assert kv.get_block_table(again.request_id) == [0, 1, 2, 4]
    assert kv.pool.num_free_blocks == 4
    kv.check_integrity()


def test_eviction_takes_the_least_recently_freed_block_first(make_request):
    scheduler, kv = make_scheduler(num_blocks=4)
    first = make_request(0, tokens=SHARED + [1], max_tokens=1)  # 4 blocks: the whole pool
    scheduler.add_request(first)
    finish_step(scheduler, scheduler.schedule())
    # free queue after finishing: [3, 2, 1, 0]; block 3 held a partial block (never cached)
    other = make_request(6)  # needs 2 blocks: takes 3, then 2 (evicting SHARED's third block)
    scheduler.add_request(other)
    scheduler.schedule()
    assert kv.get_block_table(other.request_id) == [3, 2]
    assert kv.pool.num_evictions == 1 and kv.pool.num_cached_blocks == 2
    late = make_request(0, tokens=SHARED + [9])
    assert kv.get_computed_blocks(late) == [0, 1]  # the first two survived; the third was evicted


def test_a_hash_collision_never_returns_another_prefix(make_request):
    _, kv = make_scheduler()
    kv.pool.cache_block(5, hash_block(b"", (1, 2, 3, 4)), (9, 9, 9, 9))  # forged: wrong tokens
    request = make_request(0, tokens=[1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(request) == []


def test_disabled_cache_never_hits(make_request):
    scheduler, kv = make_scheduler(caching=False)
    for _ in range(2):
        request = make_request(0, tokens=SHARED + [1])
        scheduler.add_request(request)
        finish_step(scheduler, scheduler.schedule())
    assert request.num_cached_tokens == 0 and kv.pool.num_cached_blocks == 0
