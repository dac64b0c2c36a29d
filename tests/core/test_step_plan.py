"""The step plan's deltas rebuild the scheduler's view exactly: a runner that only ever applies plans
(worker/request_state.py:apply_plan) holds, for every request a step runs, the scheduler's tokens,
block table, computed count and drafts, through prefix-cache hits, parallel samples sharing blocks,
copy on write, preemption by recompute and by swap, sliding-window frees and rolled-back drafts.
And the plan is plain data: it survives a msgspec round trip unchanged."""

import random

import msgspec
import pytest
import torch

from llmserve.config import SchedulerConfig
from llmserve.config.speculative import SpeculativeConfig
from llmserve.core.draft_planner import DraftPlanner
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.scheduler import Scheduler
from llmserve.core.step_plan import StepPlan
from llmserve.request import DraftProposal, Request, RequestStatus
from llmserve.sampling_params import SamplingParams
from llmserve.worker.request_state import apply_plan

from .test_stress import random_prefix_tree

CPU = torch.device("cpu")


def _check_mirror(scheduler: Scheduler, plan, held: dict) -> None:
    for request in plan.requests:
        state = held[request.request_id]
        assert state.all_token_ids == request.all_token_ids
        assert state.block_ids == scheduler.kv_cache.get_block_table(request.request_id)
        assert state.num_computed_tokens == request.num_computed_tokens
        assert state.spec_token_ids == request.spec_token_ids
        assert state.sampling_params is request.sampling_params


@pytest.mark.parametrize(
    "mode, window, speculate",
    [
        ("recompute", 0, False),
        ("swap", 0, True),
        ("auto", 0, False),
        ("recompute", 12, True),
        ("swap", 12, False),
    ],
)
def test_a_runner_that_applies_plans_holds_what_the_scheduler_holds(mode, window, speculate):
    rng = random.Random(f"{mode}-{window}-{speculate}")
    kv = KVCacheManager(24, 4, enable_prefix_caching=not window, num_swap_blocks=16, sliding_window=window)
    config = SchedulerConfig(48, 6, 1000, preemption_mode=mode)
    planner = DraftPlanner(SpeculativeConfig.create("ngram", 3, 2, 4, None, None, 0)) if speculate else None
    scheduler = Scheduler(config, kv, draft_planner=planner)
    paths = random_prefix_tree(rng, 80)
    pending = [p for p in (rng.choice(paths) for _ in range(150)) if kv.can_ever_fit(len(p) + 12)]
    held, requests, seen = {}, [], {"copies": 0, "resumed": 0, "rewritten": 0, "drafts": 0}
    for _ in range(20_000):
        if pending and rng.random() < 0.5:
            requests.extend(_add(scheduler, pending.pop(), rng, len(requests)))
        if rng.random() < 0.02 and scheduler.running:
            scheduler.finish_request(rng.choice(scheduler.running), RequestStatus.FINISHED_ABORTED)
        output = scheduler.schedule()
        plan = output.plan
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan) == plan
        apply_plan(held, plan, CPU)
        _check_mirror(scheduler, output, held)
        seen["copies"] += len(plan.block_copies)
        seen["resumed"] += sum(c.resumed for c in plan.cached_requests)
        seen["rewritten"] += sum(c.replace_blocks and not c.resumed for c in plan.cached_requests)
        seen["drafts"] += len(plan.spec_token_ids)
        sampled, proposals = {}, {}
        for request, n in zip(output.requests, plan.num_scheduled_tokens.values(), strict=True):
            drafts = plan.spec_token_ids.get(request.request_id, [])
            if request.num_computed_tokens + n != request.num_tokens + len(drafts):
                continue  # a prompt chunk short of the end
            accepted = drafts[: rng.randint(0, len(drafts))]
            sampled[request.request_id] = accepted + [rng.randrange(3, 500)]
            proposals[request.request_id] = DraftProposal(
                request.num_tokens + len(sampled[request.request_id]),
                [rng.randrange(3, 500) for _ in range(3)],
            )
        scheduler.update_from_output(output, sampled, proposals if speculate else None)
        kv.check_integrity()
        if not pending and not scheduler.has_unfinished_requests():
            break
    assert all(r.is_finished for r in requests)
    scheduler.add_request(Request("last", [1, 2, 3], SamplingParams(max_tokens=1)))
    apply_plan(held, scheduler.schedule().plan, CPU)
    assert set(held) == {"last"}  # finished requests reach the runner with the next plan
    assert seen["resumed"] > 0
    assert seen["rewritten"] > 0 or not (window or speculate)  # windows free blocks, drafts roll back
    assert seen["copies"] > 0 or window  # forks copy their partial block (no prefix sharing with a window)
    assert seen["drafts"] > 0 or not speculate


def _add(scheduler: Scheduler, tokens: list[int], rng: random.Random, index: int) -> list[Request]:
    params = SamplingParams(max_tokens=rng.randint(1, 12), seed=rng.choice([None, index]))
    n = 2 if rng.random() < 0.2 else 1
    children = [Request(f"q{index}-{i}", tokens, params) for i in range(n)]
    for child in children[1:]:
        child.fork_source = children[0]
    for child in children:
        scheduler.add_request(child)
    return children
