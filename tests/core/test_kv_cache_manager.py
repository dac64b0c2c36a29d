from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.config import SchedulerConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.scheduler import Scheduler
from llmserve.request import Request, RequestStatus
from llmserve.sampling_params import SamplingParams


def test_allocate_slots_grows_the_table_one_block_at_a_boundary(make_request):
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request(5)
    assert kv.allocate_slots(request, 5)
    assert kv.get_block_table(request.request_id) == [0, 1]
    request.num_computed_tokens = 5
    assert kv.allocate_slots(request, 3)  # positions 5..7 fit in block 1
    assert kv.get_block_table(request.request_id) == [0, 1]
    request.num_computed_tokens = 8
    assert kv.allocate_slots(request, 1)
    assert kv.get_block_table(request.request_id) == [0, 1, 2]
    kv.check_integrity()


def test_allocate_slots_is_all_or_nothing(make_request):
    kv = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request(12)
    assert not kv.allocate_slots(request, 12)
    assert kv.pool.num_free_blocks == 2
    assert kv.get_block_table(request.request_id) == []


def test_free_returns_every_block(make_request):
    kv = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request(9)
    kv.allocate_slots(request, 9)
    kv.free(request)
    assert kv.pool.num_free_blocks == 4
    assert request.request_id not in kv.block_tables.by_request
    kv.check_integrity()


def test_can_ever_fit():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.can_ever_fit(12)
    assert not kv.can_ever_fit(13)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 20)),
        st.tuples(st.just("step"), st.integers(0, 1), st.integers(0, 0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.integers(0, 0)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(operations, st.integers(4, 24), st.sampled_from([2, 4, 8]), st.integers(4, 64))
def test_random_workloads_never_leak_or_double_own_blocks(ops, num_blocks, block_size, budget):
    """Whatever arrives, finishes, is preempted or aborted: every block has exactly its owners,
    free + used = total after every step, and everything returns to the pool at the end."""
    kv = KVCacheManager(num_blocks, block_size)
    scheduler = Scheduler(SchedulerConfig(budget, max_num_seqs=6, max_model_len=10_000), kv)
    requests: list[Request] = []
    for kind, a, b in ops:
        if kind == "add" and kv.can_ever_fit(a + 1):
            request = Request(f"r{len(requests)}", [5] * a, SamplingParams(max_tokens=b), eos_token_ids=(2,))
            requests.append(request)
            scheduler.add_request(request)
        elif kind == "step":
            _step(scheduler, eos=bool(a))
        elif kind == "abort" and requests:
            victim = requests[a % len(requests)]
            scheduler.finish_request(victim, RequestStatus.FINISHED_ABORTED)
        kv.check_integrity()
        assert kv.pool.num_free_blocks + sum(c > 0 for c in kv.pool.ref_counts) == num_blocks
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        _step(scheduler, eos=False)
        kv.check_integrity()
    assert not scheduler.has_unfinished_requests()
    assert kv.pool.num_free_blocks == num_blocks
    assert kv.block_tables.by_request == {}


def _step(scheduler: Scheduler, eos: bool) -> None:
    plan = scheduler.schedule()
    sampled = {
        r.request_id: [2 if eos else 7]
        for r, n in zip(plan.requests, plan.plan.num_scheduled_tokens.values(), strict=True)
        if r.num_computed_tokens + n == r.num_tokens
    }
    scheduler.update_from_output(plan, sampled)
