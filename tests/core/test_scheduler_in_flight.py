"""Scheduling while earlier batches are in the pipeline (pipeline parallelism's batch queue): requests
in flight are neither scheduled nor preempted, batches come back in any order, and a request aborted
while in flight is dropped from its batch's update."""

from llmserve.request import RequestStatus
from tests.core.test_scheduler import finish_step, make_scheduler, plan_of


def test_a_second_batch_takes_only_the_requests_not_in_flight(make_request):
    scheduler, _ = make_scheduler(budget=64)
    a, b, c = make_request(4), make_request(4), make_request(4)
    for request in (a, b, c):
        scheduler.add_request(request)
    first = scheduler.schedule(max_batch_seqs=2)
    assert plan_of(first) == [(a.request_id, 4), (b.request_id, 4)]
    second = scheduler.schedule(in_flight={a.request_id, b.request_id})
    assert plan_of(second) == [(c.request_id, 4)]
    third = scheduler.schedule(in_flight={a.request_id, b.request_id, c.request_id})
    assert third.is_empty


def test_batches_update_out_of_schedule_order(make_request):
    scheduler, _ = make_scheduler(budget=64)
    a, b = make_request(4), make_request(4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule(max_batch_seqs=1)
    second = scheduler.schedule(in_flight={a.request_id})
    assert finish_step(scheduler, second, token=9) == [b]
    # b decodes again while a's prefill is still in flight
    assert plan_of(scheduler.schedule(in_flight={a.request_id})) == [(b.request_id, 1)]
    assert finish_step(scheduler, first, token=8) == [a]
    assert (a.output_token_ids, b.output_token_ids) == ([8], [9])


def test_a_request_in_flight_is_never_preempted(make_request):
    scheduler, kv = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a, b = make_request(8), make_request(8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    finish_step(scheduler, scheduler.schedule())  # both prefilled: 2 blocks each, pool full
    # a needs a third block; b, the usual victim, is in flight, so a preempts itself instead
    output = scheduler.schedule(in_flight={b.request_id})
    assert output.preempted == [a] and output.requests == []
    assert b.status == RequestStatus.RUNNING and kv.get_block_table(b.request_id) == [2, 3]
    kv.check_integrity()


def test_a_request_alone_with_others_in_flight_is_not_ended_for_lack_of_room(make_request):
    scheduler, _ = make_scheduler(num_blocks=2, block_size=4, budget=64)
    a, b = make_request(4, max_tokens=100), make_request(4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    finish_step(scheduler, scheduler.schedule())  # one block each, pool full
    output = scheduler.schedule(in_flight={b.request_id})  # a needs a second block
    assert output.preempted == [a] and not output.finished  # it waits for b, rather than ending


def test_a_request_aborted_in_flight_is_left_out_of_its_batch_update(make_request):
    scheduler, kv = make_scheduler(budget=64)
    a, b = make_request(4), make_request(4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    batch = scheduler.schedule()
    scheduler.finish_request(a, RequestStatus.FINISHED_ABORTED)
    assert finish_step(scheduler, batch) == [b]
    assert a.output_token_ids == [] and kv.get_block_table(a.request_id) == []
    kv.check_integrity()
