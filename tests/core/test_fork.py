"""Parallel samples of one prompt share its blocks; the shared partial block is copied on write."""

from llmserve.config import SchedulerConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.scheduler import Scheduler

from .test_scheduler import finish_step, plan_of


def test_siblings_share_prompt_blocks_and_copy_the_partial_block_on_first_write(make_request):
    kv = KVCacheManager(16, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(64, 8, 1000), kv)
    prompt = list(range(50, 60))  # 10 tokens: blocks 0, 1 full and block 2 holding 2 tokens
    source, first, second = (make_request(0, tokens=prompt) for _ in range(3))
    first.fork_source = second.fork_source = source
    for r in (source, first, second):
        scheduler.add_request(r)

    plan = scheduler.schedule()
    assert plan_of(plan) == [(source.request_id, 10)]  # siblings wait for the shared prompt
    finish_step(scheduler, plan)

    plan = scheduler.schedule()
    assert plan_of(plan) == [(source.request_id, 1), (first.request_id, 1), (second.request_id, 1)]
    assert kv.get_block_table(source.request_id) == [0, 1, 2]
    assert kv.get_block_table(first.request_id) == [0, 1, 3]
    assert kv.get_block_table(second.request_id) == [0, 1, 4]
    assert plan.plan.block_copies == [(2, 3), (2, 4)]
    assert kv.pool.ref_counts[:5] == [3, 3, 1, 1, 1]
    assert first.num_computed_tokens == 9  # it recomputes only the last prompt token
    kv.check_integrity()

    finish_step(scheduler, plan)
    for request in (source, first, second):
        scheduler.finish_request(request, request.status.FINISHED_ABORTED)
    assert kv.pool.num_free_blocks == 16


def test_a_block_boundary_prompt_needs_no_copy(make_request):
    kv = KVCacheManager(16, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(64, 8, 1000), kv)
    prompt = list(range(50, 59))  # 9 tokens: the sibling's last prompt token opens block 2
    source, sibling = make_request(0, tokens=prompt), make_request(0, tokens=prompt)
    sibling.fork_source = source
    scheduler.add_request(source)
    scheduler.add_request(sibling)
    finish_step(scheduler, scheduler.schedule())
    plan = scheduler.schedule()
    assert plan.plan.block_copies == []  # the sibling shares the two full blocks only
    assert kv.get_block_table(sibling.request_id) == [0, 1, 3]
    assert kv.pool.ref_counts[:4] == [2, 2, 1, 1]
