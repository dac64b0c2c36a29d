from llmserve.config import SchedulerConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.scheduler import Scheduler
from llmserve.request import RequestStatus


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, chunked=True, max_len=1000):
    kv = KVCacheManager(num_blocks, block_size)
    config = SchedulerConfig(budget, max_seqs, max_len, enable_chunked_prefill=chunked)
    return Scheduler(config, kv), kv


def plan_of(output):
    return list(output.plan.num_scheduled_tokens.items())


def finish_step(scheduler, output, token=7):
    """Feed back a token for every request that caught up, like the model runner does."""
    sampled = {
        r.request_id: [token]
        for r, n in zip(output.requests, output.plan.num_scheduled_tokens.values(), strict=True)
        if r.num_computed_tokens + n == r.num_tokens
    }
    return scheduler.update_from_output(output, sampled)


def test_long_prompt_is_chunked_and_mixed_with_decodes(make_request):
    scheduler, _ = make_scheduler(budget=32)
    a, b, c = make_request(10), make_request(20), make_request(30)
    for r in (a, b, c):
        scheduler.add_request(r)
    first = scheduler.schedule()
    assert plan_of(first) == [(a.request_id, 10), (b.request_id, 20), (c.request_id, 2)]
    updated = finish_step(scheduler, first)
    assert updated == [a, b]  # c's chunk did not reach the end of its prompt
    second = scheduler.schedule()
    assert plan_of(second) == [(a.request_id, 1), (b.request_id, 1), (c.request_id, 28)]
    finish_step(scheduler, second)
    assert c.num_output_tokens == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget(make_request):
    scheduler, _ = make_scheduler(budget=32, chunked=False)
    a, b = make_request(20), make_request(20)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert plan_of(scheduler.schedule()) == [(a.request_id, 20)]
    assert scheduler.num_waiting == 1


def test_sequence_cap(make_request):
    scheduler, _ = make_scheduler(max_seqs=2)
    for _ in range(3):
        scheduler.add_request(make_request(4))
    assert len(scheduler.schedule().requests) == 2
    assert scheduler.num_waiting == 1


def test_new_requests_join_and_finished_ones_leave_at_once(make_request):
    scheduler, kv = make_scheduler()
    a = make_request(4, max_tokens=1)
    scheduler.add_request(a)
    finish_step(scheduler, scheduler.schedule())
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert kv.pool.num_free_blocks == kv.num_blocks
    b = make_request(4)
    scheduler.add_request(b)
    assert plan_of(scheduler.schedule()) == [(b.request_id, 4)]


def test_out_of_blocks_preempts_the_most_recently_admitted(make_request):
    scheduler, kv = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a, b = make_request(8), make_request(8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    finish_step(scheduler, scheduler.schedule())  # both prefilled: 2 blocks each, pool full
    second = scheduler.schedule()  # a needs a third block
    assert second.preempted == [b]
    assert plan_of(second) == [(a.request_id, 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(scheduler.waiting) == [b]
    assert kv.get_block_table(a.request_id) == [0, 1, 3]  # b's blocks were freed last-first
    assert scheduler.num_preemptions == 1
    kv.check_integrity()


def test_preempted_request_recomputes_prompt_and_output(make_request):
    scheduler, _ = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a, b = make_request(8, max_tokens=2), make_request(8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    finish_step(scheduler, scheduler.schedule())
    finish_step(scheduler, scheduler.schedule())  # preempts b; a finishes (max_tokens=2)
    assert a.is_finished
    resumed = scheduler.schedule()
    # 8 prompt tokens + 1 generated to recompute, less b's first block, which survived in the
    # prefix cache (its second block was handed to a and evicted)
    assert plan_of(resumed) == [(b.request_id, 5)]
    assert b.num_computed_tokens == 4


def test_a_request_that_outgrows_the_whole_pool_alone_finishes_with_length(make_request):
    scheduler, kv = make_scheduler(num_blocks=2, block_size=4, budget=64)
    a = make_request(7, max_tokens=100)
    scheduler.add_request(a)
    for _ in range(3):
        finish_step(scheduler, scheduler.schedule())
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.num_tokens == 9  # 8 tokens fill the pool; the 9th has no slot
    assert kv.pool.num_free_blocks == 2


def test_stop_rules_eos_stop_ids_max_tokens_and_min_tokens(make_request):
    scheduler, _ = make_scheduler()
    eos = make_request(4)
    stop_id = make_request(4, stop_token_ids=[9])
    suppressed = make_request(4, min_tokens=2)
    for r in (eos, stop_id, suppressed):
        scheduler.add_request(r)
    plan = scheduler.schedule()
    scheduler.update_from_output(
        plan, {eos.request_id: [2], stop_id.request_id: [9], suppressed.request_id: [2]}
    )
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason == 2
    assert stop_id.status == RequestStatus.FINISHED_STOPPED and stop_id.stop_reason == 9
    assert suppressed.status == RequestStatus.RUNNING  # eos before min_tokens does not stop


def test_max_model_len_ends_generation(make_request):
    scheduler, _ = make_scheduler(max_len=6)
    a = make_request(4, max_tokens=100)
    scheduler.add_request(a)
    finish_step(scheduler, scheduler.schedule())
    finish_step(scheduler, scheduler.schedule())
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_tokens == 6


def test_abort_frees_blocks_of_waiting_and_running_requests(make_request):
    scheduler, kv = make_scheduler(max_seqs=1)
    running, waiting = make_request(8), make_request(8)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    scheduler.schedule()
    scheduler.finish_request(running, RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request(waiting, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert kv.pool.num_free_blocks == kv.num_blocks
