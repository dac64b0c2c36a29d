"""Preemption by swapping to CPU: exact block moves, resumption without recompute, fallback."""

from llmserve.config import SchedulerConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.preemption import PreemptionCosts
from llmserve.core.scheduler import Scheduler
from llmserve.request import RequestStatus

from .test_scheduler import finish_step, plan_of


def make_scheduler(mode="swap", swap_blocks=8, costs=None):
    kv = KVCacheManager(4, block_size=4, enable_prefix_caching=False, num_swap_blocks=swap_blocks)
    config = SchedulerConfig(64, 8, 1000, preemption_mode=mode)
    return Scheduler(config, kv, costs), kv


def fill_pool(scheduler, make_request):
    a, b = make_request(8), make_request(8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    finish_step(scheduler, scheduler.schedule())  # 2 blocks each: the pool is full
    return a, b


def test_swap_out_moves_the_victims_blocks_and_keeps_its_progress(make_request):
    scheduler, kv = make_scheduler()
    a, b = fill_pool(scheduler, make_request)
    plan = scheduler.schedule()
    assert plan.preempted == [b] and plan.plan.swap_out == [(2, 0), (3, 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 8
    assert kv.swap_space.tables == {b.request_id: [0, 1]}
    assert scheduler.preemptions_by_mode == {"recompute": 0, "swap": 1}
    assert scheduler.num_swapped_out_blocks == 2
    kv.check_integrity()


def test_swapped_request_resumes_with_a_swap_in_and_no_recompute(make_request):
    scheduler, kv = make_scheduler()
    a, b = fill_pool(scheduler, make_request)
    a.sampling_params.max_tokens = 2
    finish_step(scheduler, scheduler.schedule())  # b swapped out; a finishes
    assert a.is_finished
    plan = scheduler.schedule()
    assert plan_of(plan) == [(b.request_id, 1)]  # only its last sampled token: nothing recomputed
    assert [swap for swap, _ in plan.plan.swap_in] == [0, 1]
    table = kv.get_block_table(b.request_id)
    assert len(table) == 3 and table[:2] == [device for _, device in plan.plan.swap_in]
    assert kv.swap_space.tables == {} and kv.swap_space.pool.num_free_blocks == 8
    kv.check_integrity()


def test_full_swap_space_falls_back_to_recompute(make_request):
    scheduler, kv = make_scheduler(swap_blocks=1)
    _, b = fill_pool(scheduler, make_request)
    plan = scheduler.schedule()
    assert plan.preempted == [b] and plan.plan.swap_out == []
    assert b.num_computed_tokens == 0
    assert scheduler.preemptions_by_mode == {"recompute": 1, "swap": 0}


def test_abort_of_a_swapped_request_frees_its_swap_blocks(make_request):
    scheduler, kv = make_scheduler()
    _, b = fill_pool(scheduler, make_request)
    scheduler.schedule()
    scheduler.finish_request(b, RequestStatus.FINISHED_ABORTED)
    assert kv.swap_space.pool.num_free_blocks == 8
    kv.check_integrity()


def test_auto_mode_follows_the_cost_estimate(make_request):
    cheap_compute = PreemptionCosts(flops_per_token=1.0, kv_bytes_per_token=10**9, device_type="cpu")
    scheduler, _ = make_scheduler(mode="auto", costs=cheap_compute)
    fill_pool(scheduler, make_request)
    assert scheduler.schedule().plan.swap_out == []  # recomputing is estimated cheaper
    costly_compute = PreemptionCosts(flops_per_token=2.7e8, kv_bytes_per_token=46_080, device_type="cpu")
    assert costly_compute.prefer_swap(200)
    scheduler, _ = make_scheduler(mode="auto", costs=costly_compute)
    fill_pool(scheduler, make_request)
    assert len(scheduler.schedule().plan.swap_out) == 2
