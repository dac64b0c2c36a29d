"""Sliding window with attention sinks: exact blocks freed, swapping around the holes, and an engine
that keeps generating past the model's trained length in a pool too small for the whole sequence."""

import pytest

from llmserve.config import SchedulerConfig
from llmserve.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from llmserve.core.scheduler import Scheduler

from .test_scheduler import finish_step

N = NULL_BLOCK


def windowed(num_blocks=16, window=8, sinks=4, swap=0):
    return KVCacheManager(
        num_blocks,
        4,
        enable_prefix_caching=False,
        num_swap_blocks=swap,
        sliding_window=window,
        attention_sinks=sinks,
    )


def test_blocks_wholly_out_of_the_window_are_freed_and_sinks_kept(make_request):
    kv = windowed()
    request = make_request(30)
    assert kv.allocate_slots(request, 30)
    assert kv.get_block_table(request.request_id) == [0, 1, 2, 3, 4, 5, 6, 7]
    request.num_computed_tokens = 30  # next query: position 30, sees 0..3 and 23..30
    assert kv.allocate_slots(request, 1)
    assert kv.get_block_table(request.request_id) == [0, N, N, N, N, 5, 6, 7]  # block 5 holds 20..23
    assert kv.pool.num_free_blocks == 16 - 4 and kv.block_tables.num_window_evicted_blocks == 4
    request.num_computed_tokens = 31  # position 31 sees 24..31: block 5 goes too
    assert kv.allocate_slots(request, 1)
    assert kv.get_block_table(request.request_id) == [0, N, N, N, N, N, 6, 7]
    request.num_computed_tokens = 32
    assert kv.allocate_slots(request, 1)  # a new block for position 32 (freed ones queue last)
    assert kv.get_block_table(request.request_id) == [0, N, N, N, N, N, 6, 7, 8]
    kv.check_integrity()
    kv.free(request)
    assert kv.pool.num_free_blocks == 16
    kv.check_integrity()


def test_window_without_sinks_frees_the_first_block_too(make_request):
    kv = windowed(window=4, sinks=0)
    request = make_request(12)
    kv.allocate_slots(request, 12)
    request.num_computed_tokens = 12  # position 12 sees 9..12
    kv.allocate_slots(request, 1)
    assert kv.get_block_table(request.request_id) == [N, N, 2, 3]


def test_sinks_not_a_multiple_of_the_block_keep_their_whole_block(make_request):
    kv = windowed(window=4, sinks=5)  # sinks 0..4 span blocks 0 and 1
    request = make_request(20)
    kv.allocate_slots(request, 20)
    request.num_computed_tokens = 20
    kv.allocate_slots(request, 1)
    assert kv.get_block_table(request.request_id) == [0, 1, N, N, 4, 5]
    assert kv.max_blocks_per_sequence == 2 + 1 + 1


def test_swap_out_and_in_keep_the_holes(make_request):
    kv = windowed(swap=8)
    request = make_request(30)
    kv.allocate_slots(request, 30)
    request.num_computed_tokens = 30
    kv.allocate_slots(request, 1)
    assert kv.can_swap_out(request)
    moves = kv.swap_out(request)
    assert moves == [(0, 0), (5, 1), (6, 2), (7, 3)]  # live blocks only
    assert kv.swap_space.tables[request.request_id] == [0, N, N, N, N, 1, 2, 3]
    kv.check_integrity()
    request.num_computed_tokens = 31
    back = kv.swap_in(request, 1)
    table = kv.get_block_table(request.request_id)
    assert [swap for swap, _ in back] == [0, 1, 2, 3]
    assert table[1:5] == [N] * 4 and [device for _, device in back] == [table[0], *table[5:8]]
    assert kv.pool.num_free_blocks == 16 - 4 and kv.swap_space.pool.num_free_blocks == 8
    kv.check_integrity()


def test_freeing_a_swapped_request_skips_its_holes(make_request):
    kv = windowed(swap=8)
    request = make_request(30)
    kv.allocate_slots(request, 30)
    request.num_computed_tokens = 30
    kv.allocate_slots(request, 1)
    kv.swap_out(request)  # swapped table [0, N, N, N, N, 1, 2, 3]
    kv.free(request)  # aborted while swapped: only its four live swap blocks go back
    assert kv.swap_space.tables == {} and kv.swap_space.pool.num_free_blocks == 8
    assert kv.pool.num_free_blocks == 16
    kv.check_integrity()


def test_scheduler_runs_a_long_generation_in_a_bounded_number_of_blocks(make_request):
    kv = windowed(num_blocks=6, window=8, sinks=4)  # at most 1 + 2 + 1 = 4 blocks per sequence
    scheduler = Scheduler(SchedulerConfig(64, 4, 10_000), kv)
    request = make_request(10, max_tokens=300)
    scheduler.add_request(request)
    peak = 0
    while scheduler.has_unfinished_requests():
        finish_step(scheduler, scheduler.schedule())
        peak = max(peak, kv.pool.num_blocks - kv.pool.num_free_blocks)
        kv.check_integrity()
    assert request.num_output_tokens == 300 and request.num_preemptions == 0
    assert peak == kv.max_blocks_per_sequence == 4
    assert kv.pool.num_free_blocks == 6


@pytest.fixture(scope="module")
def tiny_short_context(tmp_path_factory):
    from tests.helpers import make_tiny_llama_dir

    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny_ctx64")), max_position_embeddings=64)


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu_paged", marks=pytest.mark.cpu_kernels)])
def test_engine_generates_past_the_trained_length_with_bounded_memory(tiny_short_context, backend):
    from llmserve.entrypoints.llm import LLM
    from llmserve.sampling_params import SamplingParams

    llm = LLM(
        model=tiny_short_context,  # trained on 64 positions
        dtype="float32",
        attention_backend=backend,
        block_size=4,
        num_kv_blocks=12,  # 48 tokens: less than one sequence
        max_model_len=1024,
        sliding_window=16,
        attention_sinks=4,
        max_num_seqs=2,
    )
    engine = llm.engine
    assert engine.config.cache.enable_prefix_caching is False
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(100, 130)), params)
    engine.add_request("b", list(range(200, 210)), params)
    peak, outputs = 0, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
        peak = max(
            peak, engine.kv_cache_manager.pool.num_blocks - engine.kv_cache_manager.pool.num_free_blocks
        )
        engine.kv_cache_manager.check_integrity()
    assert [len(outputs[r].outputs[0].token_ids) for r in "ab"] == [80, 80]  # 110 and 90 tokens: past 64
    assert peak <= 2 * engine.kv_cache_manager.max_blocks_per_sequence == 12
    assert engine.scheduler.num_preemptions == 0
