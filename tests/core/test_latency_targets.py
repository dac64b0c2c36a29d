"""The scheduler under latency targets, with a known step-time cost model: prompt chunks are sized to the
decodes' TPOT slack, a prompt near its TTFT deadline is admitted anyway, waiting prompts go by deadline."""

from __future__ import annotations

import time

import pytest

from llmserve.config import SchedulerConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.latency_targets import MIN_CAPPED_CHUNK
from llmserve.core.scheduler import Scheduler
from llmserve.core.step_cost import StepCostModel
from llmserve.request import Request
from llmserve.sampling_params import SamplingParams

from .test_scheduler import finish_step, plan_of

# 10 ms a step, 1 ms per decode token, 0.1 ms per prefill token, no attention terms
COST = (0.010, 0.001, 0.0001, 0.0, 0.0)
TPOT = 0.050


def make_scheduler(budget=2048, ttft_ms=1000.0, tpot_ms=50.0, policy="fcfs", cost=COST, finished=2):
    """`finished`: the output length of requests finished so far (None: none has). The default, 2
    tokens, holds a young decode's next token to one TPOT target after its last."""
    kv = KVCacheManager(1024, 16)
    config = SchedulerConfig(
        budget, 16, 8192, scheduling_policy=policy, ttft_target_ms=ttft_ms, tpot_target_ms=tpot_ms
    )
    scheduler = Scheduler(config, kv)
    if cost is not None:
        scheduler.cost_model = StepCostModel.fixed(cost)
    if finished is not None:
        scheduler.output_lengths.add(finished)
    return scheduler


_ids = iter(range(10**6))


def prompt(size: int, waited: float = 0.0, priority: int = 0, **params) -> Request:
    """A prompt of distinct tokens that arrived `waited` seconds ago."""
    index = next(_ids)
    tokens = list(range(10_000 * (index + 1), 10_000 * (index + 1) + size))
    return Request(
        f"p{index}",
        tokens,
        SamplingParams(max_tokens=64, **params),
        arrival_time=time.monotonic() - waited,
        priority=priority,
    )


def with_two_decodes(scheduler: Scheduler) -> list[Request]:
    """Two requests past their first token: every later step decodes both."""
    decodes = [prompt(8), prompt(8)]
    for request in decodes:
        scheduler.add_request(request)
    finish_step(scheduler, scheduler.schedule())
    assert all(r.first_token_time is not None for r in decodes)
    return decodes


def test_a_prompt_chunk_is_capped_to_keep_the_step_within_the_decodes_tpot_slack():
    scheduler = make_scheduler()
    a, b = with_two_decodes(scheduler)
    long = prompt(2000)
    scheduler.add_request(long)
    output = scheduler.schedule()
    model = scheduler.cost_model
    decode_step = model.predict(output.shape._replace(prefill_tokens=0, prefill_pairs=0))
    assert decode_step == pytest.approx(0.010 + 2 * 0.001)
    allowed = model.max_chunk(TPOT - decode_step, 0)  # 379 tokens of 0.1 ms in the 38 ms left
    assert 370 <= allowed <= 380
    assert plan_of(output) == [(a.request_id, 1), (b.request_id, 1), (long.request_id, allowed)]
    assert model.predict(output.shape) <= TPOT
    finish_step(scheduler, output)
    # The next step: the decodes have 2 tokens, so their next is due by first + 2 x TPOT; what the
    # first step left of that (it took no time here) is slack the running prompt's next chunk gets.
    before = time.monotonic()
    second = scheduler.schedule()
    after = time.monotonic()

    def chunk_at(now: float) -> int:
        slack = min(r.first_token_time + TPOT * r.num_output_tokens - now for r in (a, b))
        return model.max_chunk(max(TPOT, slack) - decode_step, 0)

    assert plan_of(second)[:2] == [(a.request_id, 1), (b.request_id, 1)]
    assert chunk_at(after) <= plan_of(second)[2][1] <= chunk_at(before)
    assert plan_of(second)[2][1] >= allowed


@pytest.mark.parametrize("finished", [None, 64])
def test_a_young_decode_spends_the_slack_of_its_whole_expected_output(finished):
    # the decodes (max_tokens 64) are expected to produce 64 tokens: their max_tokens before any request
    # has finished, else the finished ones' typical length. At 12 ms a step their TPOT over 63 tokens
    # leaves 63 x (50 - 12) ms for this step: the prompt is not capped
    scheduler = make_scheduler(finished=finished)
    a, b = with_two_decodes(scheduler)
    long = prompt(2000)
    scheduler.add_request(long)
    assert plan_of(scheduler.schedule()) == [(a.request_id, 1), (b.request_id, 1), (long.request_id, 2000)]


def test_without_decodes_or_before_the_model_is_fitted_nothing_is_capped():
    scheduler = make_scheduler(budget=1500)
    long = prompt(2000)
    scheduler.add_request(long)
    assert plan_of(scheduler.schedule()) == [(long.request_id, 1500)]  # no decode to protect
    unfitted = make_scheduler(cost=None)
    a, b = with_two_decodes(unfitted)
    other = prompt(2000)
    unfitted.add_request(other)
    assert plan_of(unfitted.schedule()) == [(a.request_id, 1), (b.request_id, 1), (other.request_id, 2000)]


@pytest.mark.parametrize(
    ("waited", "params", "urgent"),
    [
        (0.0, {}, False),  # planned by 0.5 s (half its 1 s target) - 0.2 s of prefill: plenty of slack
        (0.2, {}, False),  # 0.1 s of slack: still more than a step (12 ms)
        (0.29, {}, True),  # 10 ms of slack: under one step, nearly exhausted
        (0.7, {}, True),  # past its planned first token, its target still in reach: it goes at once
        (0.95, {}, True),  # its prefill can no longer meet the target: it goes at once, not last
        (5.0, {}, True),  # long past its deadline: never starved
        (0.0, {"ttft_target_ms": 300.0}, True),  # its own tighter target: 0.15 s planned, 0.2 s to prefill
        (0.29, {"ttft_target_ms": 5000.0}, False),  # its own looser target
    ],
)
def test_a_prompt_whose_ttft_slack_is_nearly_exhausted_is_admitted_whole(waited, params, urgent):
    scheduler = make_scheduler()
    with_two_decodes(scheduler)
    long = prompt(2000, waited=waited, **params)  # 0.2 s of predicted prefill
    scheduler.add_request(long)
    chunk = dict(plan_of(scheduler.schedule()))[long.request_id]
    assert chunk == 2000 if urgent else chunk < 400


def test_waiting_prompts_go_by_ttft_deadline_and_fcfs_without_targets():
    scheduler = make_scheduler(budget=600)
    short_early = prompt(10, waited=0.05)  # due in 0.95 s
    long_late = prompt(3000)  # due in 1 s (its slack, less its 0.3 s of prefill, is the smaller)
    tight = prompt(10, ttft_target_ms=200.0)  # due in 0.2 s: first of all
    for request in (long_late, short_early, tight):
        scheduler.add_request(request)
    # by deadline, not slack: `short_early` came first and does not wait for `long_late`'s prefill
    assert plan_of(scheduler.schedule()) == [
        (tight.request_id, 10),
        (short_early.request_id, 10),
        (long_late.request_id, 580),
    ]
    plain = make_scheduler(budget=600, ttft_ms=0, tpot_ms=0)  # no targets: arrival order
    for request in (prompt(3000), prompt(10, waited=0.05), prompt(10, ttft_target_ms=200.0)):
        plain.add_request(request)
    assert [n for _, n in plan_of(plain.schedule())] == [600]


def test_deadlines_order_prompts_within_a_priority_level_not_across_levels():
    scheduler = make_scheduler(budget=4000, policy="priority")
    early_low = prompt(3000, priority=1, waited=0.1)  # the earliest deadline, but a lower priority
    late = prompt(10, priority=0)
    early = prompt(2000, priority=0, waited=0.01)  # due before `late`: first among priority 0
    for request in (early_low, late, early):
        scheduler.add_request(request)
    order = [request_id for request_id, _ in plan_of(scheduler.schedule())]
    assert order == [early.request_id, late.request_id, early_low.request_id]


def test_a_preempted_request_resumes_before_waiting_prompts():
    scheduler = make_scheduler(budget=4000)
    resumed = prompt(20)
    scheduler.add_request(resumed)
    finish_step(scheduler, scheduler.schedule())
    scheduler._preempt(resumed, scheduler.schedule())  # as under KV pressure: back to waiting
    urgent_prompt = prompt(2000, waited=0.9)
    scheduler.add_request(urgent_prompt)
    order = [request_id for request_id, _ in plan_of(scheduler.schedule())]
    assert order == [resumed.request_id, urgent_prompt.request_id]


def test_no_chunk_is_capped_while_the_prompt_backlog_would_miss_its_ttft_targets():
    """Prompts of 0.2 s of prefill each, served one after another: two fit in the half of their 1 s TTFT
    target the scheduler plans by, so the first is capped to the decodes' TPOT slack; with a third
    behind them they would not, so the first goes at the full token budget (a burst is cleared as fast
    as the machine can)."""
    for num_prompts, capped in ((2, True), (3, False)):
        scheduler = make_scheduler(budget=2048)
        a, b = with_two_decodes(scheduler)
        prompts = [prompt(2000) for _ in range(num_prompts)]
        for request in prompts:
            scheduler.add_request(request)
        plan = dict(plan_of(scheduler.schedule()))
        assert (plan[prompts[0].request_id] < 400) is capped
        assert sum(plan.values()) == (2 + plan[prompts[0].request_id] if capped else 2048)


def test_prompts_share_a_step_as_far_as_the_decodes_slack_allows():
    """Two prompts whose prefill (10 + 25 ms) fits the 38 ms the decodes' TPOT slack leaves both get
    their first tokens from one step; a third would get a sliver of what is left (3 ms: about 30
    tokens), under the smallest capped chunk, so it waits; with more slack left it gets its share."""
    scheduler = make_scheduler()
    a, b = with_two_decodes(scheduler)
    first, second, third = prompt(100, waited=0.2), prompt(250, waited=0.1), prompt(300)
    for request in (first, second, third):
        scheduler.add_request(request)
    plan = dict(plan_of(scheduler.schedule()))
    assert plan[first.request_id] == 100 and plan[second.request_id] == 250
    assert third.request_id not in plan
    roomier = make_scheduler()
    with_two_decodes(roomier)
    first, third = prompt(100, waited=0.2), prompt(300)
    for request in (first, third):
        roomier.add_request(request)
    plan = dict(plan_of(roomier.schedule()))
    left = TPOT - (0.010 + 2 * 0.001) - 0.010  # 28 ms: about 280 tokens of the third
    assert plan[first.request_id] == 100
    assert MIN_CAPPED_CHUNK <= plan[third.request_id] <= roomier.cost_model.max_chunk(left, 0) + 1 < 300


def test_the_backlog_check_counts_a_step_of_decodes_per_prompt():
    """20 prompts of 20 ms of prefill each fit the half of their 1 s TTFT targets the scheduler plans by
    on prefill alone (0.4 s), but not served one per step beside the decodes' 12 ms (0.64 s): that
    backlog lifts the caps, so the first step takes as many prompts as the token budget holds rather
    than one."""
    scheduler = make_scheduler(budget=2048)
    a, b = with_two_decodes(scheduler)
    prompts = [prompt(200) for _ in range(20)]
    for request in prompts:
        scheduler.add_request(request)
    plan = dict(plan_of(scheduler.schedule()))
    assert sum(request.request_id in plan for request in prompts) == 11  # 10 whole, 46 tokens of one
