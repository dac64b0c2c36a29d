"""Priority scheduling: order, preemption of the least urgent, and aging against starvation."""

from llmserve.config import SchedulerConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.scheduler import Scheduler
from llmserve.request import RequestStatus

from .test_scheduler import finish_step, plan_of


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, aging=10.0):
    kv = KVCacheManager(num_blocks, block_size=4)
    config = SchedulerConfig(
        budget, max_seqs, 1000, scheduling_policy="priority", priority_aging_seconds=aging
    )
    return Scheduler(config, kv), kv


def prioritized(make_request, size, priority, arrival):
    request = make_request(size)
    request.priority, request.arrival_time = priority, arrival
    return request


def test_waiting_requests_run_by_priority_then_arrival(make_request):
    scheduler, _ = make_scheduler(max_seqs=2)
    batch = prioritized(make_request, 4, priority=1, arrival=100.0)
    late_urgent = prioritized(make_request, 4, priority=0, arrival=101.0)
    early_urgent = prioritized(make_request, 4, priority=0, arrival=100.5)
    for r in (batch, late_urgent, early_urgent):
        scheduler.add_request(r)
    assert plan_of(scheduler.schedule()) == [(early_urgent.request_id, 4), (late_urgent.request_id, 4)]


def test_an_urgent_request_preempts_the_least_urgent_running_one(make_request):
    scheduler, kv = make_scheduler(num_blocks=5)
    low = prioritized(make_request, 8, priority=2, arrival=100.0)
    mid = prioritized(make_request, 8, priority=1, arrival=100.0)
    scheduler.add_request(low)
    scheduler.add_request(mid)
    finish_step(scheduler, scheduler.schedule())  # both run; one block is left
    urgent = prioritized(make_request, 6, priority=0, arrival=101.0)
    scheduler.add_request(urgent)
    plan = scheduler.schedule()
    assert plan.preempted == [low]
    assert low.status == RequestStatus.PREEMPTED
    assert plan_of(plan) == [(mid.request_id, 1), (urgent.request_id, 6)]
    kv.check_integrity()


def test_a_less_urgent_request_never_preempts(make_request):
    scheduler, _ = make_scheduler(num_blocks=4)
    a = prioritized(make_request, 8, priority=0, arrival=100.0)
    b = prioritized(make_request, 8, priority=0, arrival=100.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    finish_step(scheduler, scheduler.schedule())
    scheduler.add_request(prioritized(make_request, 6, priority=5, arrival=101.0))
    assert scheduler.schedule().preempted[:1] != [a]  # only KV pressure among equals may preempt
    assert a.status == RequestStatus.RUNNING


def test_under_kv_pressure_the_least_urgent_running_request_is_preempted(make_request):
    scheduler, _ = make_scheduler(num_blocks=4)
    urgent_late = prioritized(make_request, 8, priority=0, arrival=101.0)
    lax_early = prioritized(make_request, 8, priority=3, arrival=100.0)
    scheduler.add_request(lax_early)
    scheduler.add_request(urgent_late)
    finish_step(scheduler, scheduler.schedule())
    plan = scheduler.schedule()  # both need a third block; only the urgent one gets it
    assert plan.preempted == [lax_early]
    assert plan_of(plan) == [(urgent_late.request_id, 1)]


def test_aging_lets_a_long_waiting_low_priority_request_go_first(make_request):
    scheduler, _ = make_scheduler(max_seqs=1, aging=10.0)
    starved = prioritized(make_request, 4, priority=1, arrival=100.0)
    fresh = prioritized(make_request, 4, priority=0, arrival=111.0)  # 11 s later: more than one level
    scheduler.add_request(fresh)
    scheduler.add_request(starved)
    assert plan_of(scheduler.schedule()) == [(starved.request_id, 4)]


def test_aging_does_not_override_priority_within_the_aging_interval(make_request):
    scheduler, _ = make_scheduler(max_seqs=1, aging=10.0)
    lax = prioritized(make_request, 4, priority=1, arrival=100.0)
    urgent = prioritized(make_request, 4, priority=0, arrival=109.0)
    scheduler.add_request(lax)
    scheduler.add_request(urgent)
    assert plan_of(scheduler.schedule()) == [(urgent.request_id, 4)]
