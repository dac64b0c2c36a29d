"""Pipeline parallelism end to end on tiny float32 models: the same tokens as one process, with two
batches in the pipeline at once and no request in both.

Every engine here runs its stages as real processes over gloo. Greedy tokens must equal one
process's, except after a step whose top two logits were within 1e-4; seeded sampling and log-probs
must match too, since rank 0 samples the last stage's logits.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from llmserve import SamplingParams
from llmserve.config import EngineArgs
from llmserve.engine.async_llm import AsyncLLM
from llmserve.worker.executor import TensorParallelError
from tests.distributed.conftest import ENGINE_KWARGS, REPEATING, UNEVEN_HEADS, assert_same_greedy, engine
from tests.distributed.test_tensor_parallel import PARAMS, PROMPTS, REQUESTS, _run_steps
from tests.helpers import make_tiny_llama_dir

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def three_layer_llama_dir(tmp_path_factory) -> str:
    """Three layers: two stages split them 2 + 1."""
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("pp-llama")), num_hidden_layers=3, **UNEVEN_HEADS)


@pytest.fixture(scope="module")
def references(three_layer_llama_dir, tiny_qwen2_dir) -> dict[str, list]:
    outputs = {}
    for name, path in (("llama", three_layer_llama_dir), ("qwen2", tiny_qwen2_dir)):
        with engine(path) as llm:
            outputs[name] = llm.generate(REQUESTS, PARAMS, use_tqdm=False)
    return outputs


def _watch_in_flight(llm) -> list[list[frozenset[str]]]:
    """Every time rank 0 submits a batch, the request ids of each batch then in flight, its own too."""
    queue, seen = llm.engine.batch_queue, []
    submit = queue.driver.submit

    def watched(plan):
        seen.append([batch.request_ids for batch in queue.in_flight] + [frozenset(plan.num_scheduled_tokens)])
        return submit(plan)

    queue.driver.submit = watched
    return seen


@pytest.mark.parametrize(
    ("model", "tp", "pp", "stage0_layers"),
    [("qwen2", 1, 2, 1), ("llama", 2, 2, 2)],  # llama alone at PP=2: the abort and preemption tests
)
def test_greedy_and_seeded_sampling_match_one_process(
    model, tp, pp, stage0_layers, references, three_layer_llama_dir, tiny_qwen2_dir
):
    path = three_layer_llama_dir if model == "llama" else tiny_qwen2_dir
    with engine(path, tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        seen = _watch_in_flight(llm)
        outputs = llm.generate(REQUESTS, PARAMS, use_tqdm=False)
        kv_layers, kv_heads = (
            llm.engine.model_runner.kv_cache.shape[0],
            llm.engine.model_runner.kv_cache.shape[3],
        )
        workers = llm.engine.executor.launcher.processes
    assert (kv_layers, kv_heads) == (stage0_layers, {1: 3, 2: 2}[tp])  # rank 0's layers and KV heads
    assert [worker.exitcode for worker in workers] == [0] * (tp * pp - 1)  # shutdown stopped them cleanly
    # two batches were in the pipeline at once, and no request was in both
    assert max(map(len, seen)) == pp  # never more batches than stages
    overlapping = [batches for batches in seen if len(batches) == 2]
    assert len(overlapping) >= 10
    for first, second in overlapping:
        assert first and second and not first & second
    reference = references[model]
    for want, got in zip(reference[: len(PROMPTS)], outputs[: len(PROMPTS)], strict=True):
        assert_same_greedy(want, got)
    for want, got in zip(reference[len(PROMPTS) :], outputs[len(PROMPTS) :], strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for want_entry, got_entry in zip(want.outputs[0].logprobs, got.outputs[0].logprobs, strict=True):
            assert got_entry.keys() == want_entry.keys()
            assert list(got_entry.values()) == pytest.approx(list(want_entry.values()), abs=1e-4)


SHARED = list(range(2000, 2040))  # 2.5 blocks of 16 shared by every prompt
PREEMPTED_PROMPTS = [SHARED + [index, index + 7] for index in range(6)]
PREEMPTED_PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def preemption_reference(three_layer_llama_dir) -> dict[str, list[int]]:
    with engine(three_layer_llama_dir, block_size=16) as llm:
        return _run_steps(llm, PREEMPTED_PROMPTS, PREEMPTED_PARAMS)[0]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_prefix_caching_keep_the_tokens(mode, preemption_reference, three_layer_llama_dir):
    # 20 blocks of 16 tokens cannot hold six sequences of 82 tokens at once: requests get preempted
    with engine(
        three_layer_llama_dir, pipeline_parallel_size=2, block_size=16, num_kv_blocks=20, preemption_mode=mode
    ) as llm:
        got, preemptions = _run_steps(llm, PREEMPTED_PROMPTS, PREEMPTED_PARAMS)
        hits = llm.engine.kv_cache_manager.prefix_cache_hits
        record = llm.engine.batch_queue.record
        scheduler = llm.engine.scheduler
    assert preemptions > 0 and scheduler.preemptions_by_mode[mode] > 0
    assert hits >= 32 * 5  # the shared full blocks, for every prompt after the first
    assert record.max_in_flight == 2
    assert got == preemption_reference


def test_a_request_aborted_while_its_batch_is_in_flight(references, three_layer_llama_dir):
    with engine(three_layer_llama_dir, pipeline_parallel_size=2) as llm:
        for index, prompt in enumerate(PROMPTS):
            llm.engine.add_request(str(index), prompt, PARAMS[index])
        llm.engine.step()
        (in_flight,) = llm.engine.batch_queue.in_flight  # the second batch, still in the pipeline
        victim = sorted(in_flight.request_ids)[0]
        llm.engine.abort_request(victim)
        got = {}
        while llm.engine.has_unfinished_requests():  # it takes back the aborted request's batch too
            for output in llm.engine.step():
                assert output.request_id != victim
                if output.finished:
                    got[output.request_id] = output
    assert sorted(got) == sorted(str(index) for index in range(len(PROMPTS)) if str(index) != victim)
    for request_id, output in got.items():
        assert_same_greedy(references["llama"][int(request_id)], output)


def test_every_stage_reports_its_own_rank_stats(three_layer_llama_dir):
    """Rank 0 (stage 0) and the worker (stage 1) each count their own steps and forward time, and
    report their own KV pool, for the per-rank series on /metrics."""
    with engine(three_layer_llama_dir, pipeline_parallel_size=2) as llm:
        llm.generate(REQUESTS, PARAMS, use_tqdm=False)
        stats = llm.engine.rank_stats()
        (worker,) = llm.engine.executor.launcher.processes
    assert [report.rank for report in stats] == [0, 1]
    assert stats[0].pid == os.getpid() and stats[1].pid == worker.pid
    for report in stats:
        assert report.num_steps > 0 and report.forward_seconds > 0, report
        assert report.kv_num_blocks > 0 and report.kv_cache_bytes > 0
    # stage 0 holds two of the three layers' KV, stage 1 one: equal block counts, unequal bytes
    assert stats[0].kv_num_blocks == stats[1].kv_num_blocks
    assert stats[0].kv_cache_bytes == 2 * stats[1].kv_cache_bytes


def test_ngram_speculation_under_pipeline_parallelism(three_layer_llama_dir):
    """Rank 0 drafts after each batch comes back and verifies the last stage's k + 1 logits rows."""
    params = REPEATING
    with engine(three_layer_llama_dir) as llm:
        reference = llm.generate(PROMPTS, params, use_tqdm=False)
    kwargs = dict(speculative_method="ngram", speculative_disable_batch_size=0)
    with engine(three_layer_llama_dir, pipeline_parallel_size=2, **kwargs) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        accepted = llm.engine.spec_decode_stats.num_accepted_tokens
        record = llm.engine.batch_queue.record
    assert accepted > 0 and record.max_in_flight == 2
    for want, got in zip(reference, outputs, strict=True):
        assert_same_greedy(want, got)


async def _stream_all(llm: AsyncLLM, prompts: list[list[int]], params: SamplingParams) -> list:
    async def last(index: int, prompt: list[int]):
        outputs = [output async for output in llm.generate(prompt, params, f"s{index}")]
        return outputs[-1]  # cumulative: the whole completion

    return await asyncio.gather(*(last(index, prompt) for index, prompt in enumerate(prompts)))


def test_the_server_engine_process_streams_the_same_tokens(references, three_layer_llama_dir):
    llm = AsyncLLM(EngineArgs(model=three_layer_llama_dir, pipeline_parallel_size=2, **ENGINE_KWARGS))
    try:
        outputs = asyncio.run(asyncio.wait_for(_stream_all(llm, PROMPTS, PARAMS[0]), timeout=120))
    finally:
        llm.shutdown()
    for want, got in zip(references["llama"][: len(PROMPTS)], outputs, strict=True):
        assert_same_greedy(want, got)


def test_a_stage_that_dies_fails_the_step_with_its_rank_named(three_layer_llama_dir):
    with engine(three_layer_llama_dir, pipeline_parallel_size=2) as llm:
        llm.engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
        llm.engine.step()
        (worker,) = llm.engine.executor.launcher.processes
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(30)
        for _ in range(2):  # and every step after it: the pipeline cannot be resynchronized
            with pytest.raises(
                TensorParallelError, match=r"^pipeline stage 1's rank 1 \(pid \d+\) exited with code -9$"
            ):
                llm.engine.step()
