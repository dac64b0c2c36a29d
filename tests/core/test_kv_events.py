"""KV events: exact events for known steps, and over random workloads the replayed events always give
exactly the pool's cached hashes (the router's index is the engine's cache, not an estimate)."""

import random

import msgspec
import pytest

from llmserve.config import SchedulerConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from llmserve.core.prefix_cache import hash_block
from llmserve.core.scheduler import Scheduler
from llmserve.router.index import PrefixIndex

from .test_scheduler import finish_step
from .test_stress import _add, random_prefix_tree

SHARED = list(range(100, 112))  # three full blocks of 4


def make_scheduler(num_blocks=16, events=True):
    kv = KVCacheManager(num_blocks, block_size=4, enable_kv_events=events)
    return Scheduler(SchedulerConfig(64, 8, 1000), kv), kv


def chain(tokens, size=4):
    hashes = []
    for start in range(0, len(tokens) - size + 1, size):
        hashes.append(hash_block(hashes[-1] if hashes else b"", tuple(tokens[start : start + size])))
    return hashes


def test_a_computed_prompt_is_one_block_stored_event_with_the_engines_hashes(make_request):
    scheduler, kv = make_scheduler()
    request = make_request(0, tokens=SHARED + [1, 2])
    scheduler.add_request(request)
    finish_step(scheduler, scheduler.schedule())
    (event,) = kv.take_events()
    assert event == BlockStored(chain(SHARED), None, SHARED, 4, None, None)
    assert event.block_hashes == kv.prefix_cache.block_hashes(request)[:3]
    assert kv.take_events() == []


def test_a_block_filled_by_decoding_names_its_parent(make_request):
    scheduler, kv = make_scheduler()
    request = make_request(0, tokens=SHARED[:8] + [1], max_tokens=8)
    scheduler.add_request(request)
    for token in (7, 5, 6, 8):  # the prompt, then decodes until position 11 is computed
        finish_step(scheduler, scheduler.schedule(), token=token)
    first, second = kv.take_events()
    hashes = chain(SHARED[:8] + [1, 7, 5, 6])
    assert first == BlockStored(hashes[:2], None, SHARED[:8], 4, None, None)
    assert second == BlockStored([hashes[2]], hashes[1], [1, 7, 5, 6], 4, None, None)


def test_a_prefix_hit_stores_nothing_new(make_request):
    scheduler, kv = make_scheduler()
    scheduler.add_request(make_request(0, tokens=SHARED + [1]))
    finish_step(scheduler, scheduler.schedule())
    kv.take_events()
    scheduler.add_request(make_request(0, tokens=SHARED + [2]))
    finish_step(scheduler, scheduler.schedule())
    assert kv.take_events() == []


def test_eviction_is_a_block_removed_event_and_reset_clears_all(make_request):
    scheduler, kv = make_scheduler(num_blocks=4)
    first = make_request(0, tokens=SHARED[:8] + [1], max_tokens=1)
    scheduler.add_request(first)
    finish_step(scheduler, scheduler.schedule())
    kv.take_events()
    other = make_request(15)  # needs all four blocks: both cached blocks are handed out again
    scheduler.add_request(other)
    scheduler.schedule()
    (removed,) = kv.take_events()
    assert isinstance(removed, BlockRemoved) and set(removed.block_hashes) == set(chain(SHARED[:8]))
    kv.pool.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]


def test_the_managers_reset_forgets_prefixes_and_counts(make_request):
    scheduler, kv = make_scheduler()
    scheduler.add_request(make_request(0, tokens=SHARED + [1]))
    finish_step(scheduler, scheduler.schedule())
    scheduler.add_request(make_request(0, tokens=SHARED + [2]))
    finish_step(scheduler, scheduler.schedule())
    assert kv.prefix_cache_hits > 0
    kv.take_events()
    kv.reset_prefix_cache()
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    assert kv.take_events() == [AllBlocksCleared()]
    scheduler.add_request(make_request(0, tokens=SHARED + [3]))
    finish_step(scheduler, scheduler.schedule())
    assert kv.prefix_cache_queries > 0 and kv.prefix_cache_hits == 0  # nothing cached survived


def test_no_events_are_recorded_unless_asked(make_request):
    scheduler, kv = make_scheduler(events=False)
    scheduler.add_request(make_request(0, tokens=SHARED + [1]))
    finish_step(scheduler, scheduler.schedule())
    assert kv.pool.events is None and kv.take_events() == []


def test_the_batch_round_trips_in_vllms_array_layout():
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored([b"h1"], None, [1, 2], 2, None, None),
            BlockRemoved([b"h1"], None),
            AllBlocksCleared(),
        ],
    )
    assert decode_batch(encode_batch(batch)) == batch
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw == [
        1.5,
        [
            ["BlockStored", [b"h1"], None, [1, 2], 2, None, None],
            ["BlockRemoved", [b"h1"], None],
            ["AllBlocksCleared"],
        ],
        None,  # data_parallel_rank
    ]


@pytest.mark.parametrize("seed", range(3))
def test_replayed_events_equal_the_pools_cache_after_every_step(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=24, block_size=4, enable_prefix_caching=True, enable_kv_events=True)
    scheduler = Scheduler(SchedulerConfig(48, 6, 1000, preemption_mode="recompute"), kv)
    index = PrefixIndex(["replica"])
    paths = random_prefix_tree(rng, 60)
    pending = [p for p in (rng.choice(paths) for _ in range(150)) if kv.can_ever_fit(len(p) + 8)]
    num_removed = 0
    for step in range(5_000):
        if pending and rng.random() < 0.5:
            _add(scheduler, pending.pop(), rng, step)
        plan = scheduler.schedule()
        sampled = {
            r.request_id: [rng.randrange(3, 500)]
            for r, n in zip(plan.requests, plan.plan.num_scheduled_tokens.values(), strict=True)
            if r.num_computed_tokens + n == r.num_tokens
        }
        scheduler.update_from_output(plan, sampled)
        events = kv.take_events()
        num_removed += sum(isinstance(e, BlockRemoved) for e in events)
        index.apply("replica", decode_batch(encode_batch(KVEventBatch(ts=0.0, events=events))))
        assert index.stored("replica") == set(kv.pool._cached), f"step {step}"
        if not pending and not scheduler.has_unfinished_requests():
            break
    assert num_removed > 0 and kv.pool.num_cached_blocks > 0
