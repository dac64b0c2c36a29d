"""Prefix-cache query and hit counters: one count per request, at its first admission."""

from .test_prefix_cache import SHARED, make_scheduler
from .test_scheduler import finish_step, plan_of


def test_a_recomputed_request_is_not_counted_again(make_request):
    scheduler, kv = make_scheduler(num_blocks=4, budget=64)
    a, b = make_request(8, max_tokens=2), make_request(8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    finish_step(scheduler, scheduler.schedule())
    finish_step(scheduler, scheduler.schedule())  # preempts b (recompute); a finishes
    assert b.num_preemptions == 1 and a.is_finished
    resumed = scheduler.schedule()
    assert plan_of(resumed) == [(b.request_id, 5)]  # its first block came back from the prefix cache
    assert b.num_computed_tokens == 4 and b.num_cached_tokens == 0  # as found at its first admission
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (8 + 8, 0)


def test_counters_add_each_first_lookup_in_tokens(make_request):
    scheduler, kv = make_scheduler()
    first = make_request(0, tokens=SHARED + [1, 2])
    scheduler.add_request(first)
    finish_step(scheduler, scheduler.schedule())
    later = [make_request(0, tokens=SHARED[:8] + [5, 6, 7]), make_request(0, tokens=SHARED + [9])]
    for request in later:
        scheduler.add_request(request)
    finish_step(scheduler, scheduler.schedule())
    assert [r.num_cached_tokens for r in later] == [8, 12]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (14 + 11 + 13, 8 + 12)


def test_nothing_is_counted_with_prefix_caching_off(make_request):
    scheduler, kv = make_scheduler(caching=False)
    for _ in range(2):
        scheduler.add_request(make_request(0, tokens=SHARED + [1]))
        finish_step(scheduler, scheduler.schedule())
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
