"""Hundreds of requests drawn from a random tree of shared prefixes against a tiny pool: every one
finishes, nothing errors, no block leaks, in every preemption mode and policy."""

import random

import pytest

from llmserve.config import SchedulerConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.scheduler import Scheduler
from llmserve.request import Request, RequestStatus
from llmserve.sampling_params import SamplingParams


def random_prefix_tree(rng: random.Random, num_nodes: int) -> list[list[int]]:
    """Token paths of a random tree: each node extends a random earlier node by 1-20 tokens."""
    paths = [[]]
    for _ in range(num_nodes):
        parent = rng.choice(paths)
        paths.append(parent + [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))])
    return [p for p in paths if p]


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_prefix_tree_workload_finishes_without_leaks(mode, policy):
    rng = random.Random(f"{mode}-{policy}")
    kv = KVCacheManager(num_blocks=24, block_size=4, enable_prefix_caching=True, num_swap_blocks=16)
    config = SchedulerConfig(48, 6, 1000, scheduling_policy=policy, preemption_mode=mode)
    scheduler = Scheduler(config, kv)
    paths = random_prefix_tree(rng, 120)
    pending = [p for p in (rng.choice(paths) for _ in range(300)) if kv.can_ever_fit(len(p) + 8)]
    requests: list[Request] = []
    for _ in range(20_000):
        if pending and rng.random() < 0.5:
            requests.extend(_add(scheduler, pending.pop(), rng, len(requests)))
        if rng.random() < 0.02 and scheduler.running:
            scheduler.finish_request(rng.choice(scheduler.running), RequestStatus.FINISHED_ABORTED)
        plan = scheduler.schedule()
        sampled = {
            r.request_id: [rng.randrange(3, 500)]
            for r, n in zip(plan.requests, plan.plan.num_scheduled_tokens.values(), strict=True)
            if r.num_computed_tokens + n == r.num_tokens
        }
        scheduler.update_from_output(plan, sampled)
        kv.check_integrity()
        if not pending and not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests(), "requests are stuck"
    assert all(r.is_finished for r in requests)
    assert kv.pool.num_free_blocks == 24 and kv.swap_space.pool.num_free_blocks == 16
    assert kv.block_tables.by_request == {} and kv.swap_space.tables == {}
    assert kv.prefix_cache_hits > 0
    if mode != "recompute":
        assert scheduler.preemptions_by_mode["swap"] > 0
    assert scheduler.num_preemptions > 0


def _add(scheduler: Scheduler, tokens: list[int], rng: random.Random, index: int) -> list[Request]:
    params = SamplingParams(max_tokens=rng.randint(1, 8))
    n = 2 if rng.random() < 0.2 else 1
    children = [Request(f"q{index}-{i}", tokens, params, priority=rng.randint(0, 2)) for i in range(n)]
    for child in children[1:]:
        child.fork_source = children[0]
    for child in children:
        scheduler.add_request(child)
    return children
