"""Tensor parallelism end to end on tiny float32 models: the same tokens as one process.

Every engine here runs its ranks as real processes over gloo. Greedy tokens must equal one
process's, except after a step whose top two logits were within 1e-4 (sums in another order);
seeded sampling and log-probs must match too, since rank 0 samples from the gathered logits.
"""

from __future__ import annotations

import os
import signal

import pytest

from llmserve import LLM, SamplingParams
from llmserve.benchmarks.throughput import run_throughput
from llmserve.benchmarks.workload import BenchRequest
from llmserve.worker.executor import TensorParallelError
from tests.distributed.conftest import ENGINE_KWARGS, REPEATING, assert_same_greedy, engine

pytestmark = pytest.mark.process

PROMPTS = [
    [5, 6, 7, 8] * 6,
    [100, 200, 300] * 5 + [9],
    list(range(1000, 1040)),
    [42] * 3,
    [31, 4159, 2653, 17, 9000],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)


def _seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=16, ignore_eos=True, logprobs=2)


# each prompt greedy, then each prompt sampled with its own seed
REQUESTS = PROMPTS + PROMPTS
PARAMS = [GREEDY] * len(PROMPTS) + [_seeded(seed) for seed in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def references(tiny_llama_dir, tiny_qwen2_dir) -> dict[str, list]:
    """One process's outputs for each model."""
    outputs = {}
    for name, path in (("llama", tiny_llama_dir), ("qwen2", tiny_qwen2_dir)):
        with engine(path) as llm:
            outputs[name] = llm.generate(REQUESTS, PARAMS, use_tqdm=False)
    return outputs


@pytest.mark.parametrize(("model", "tp"), [("llama", 2), ("llama", 3), ("qwen2", 2)])
def test_greedy_and_seeded_sampling_match_one_process(model, tp, references, tiny_llama_dir, tiny_qwen2_dir):
    path = tiny_llama_dir if model == "llama" else tiny_qwen2_dir
    with engine(path, tensor_parallel_size=tp) as llm:
        outputs = llm.generate(REQUESTS, PARAMS, use_tqdm=False)
        # alone, a request's decode steps take the fused stack (float32: up to 8 rows), whose
        # all-reduces go through the ranks' shared memory
        alone = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
        runner = llm.engine.model_runner
        kv_heads = runner.kv_cache.shape[3]
        fused_steps, shared_memory = runner.decode_stack.calls, runner.model.tp.shm is not None
    assert kv_heads == {2: 2, 3: 1}[tp]  # rank 0's share of the 3 KV heads
    assert fused_steps >= GREEDY.max_tokens - 1 and shared_memory
    reference = references[model]
    assert_same_greedy(reference[0], alone)
    for want, got in zip(reference[: len(PROMPTS)], outputs[: len(PROMPTS)], strict=True):
        assert_same_greedy(want, got)
    for want, got in zip(reference[len(PROMPTS) :], outputs[len(PROMPTS) :], strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for want_entry, got_entry in zip(want.outputs[0].logprobs, got.outputs[0].logprobs, strict=True):
            assert got_entry.keys() == want_entry.keys()
            assert list(got_entry.values()) == pytest.approx(list(want_entry.values()), abs=1e-4)


def _run_steps(llm, prompts: list[list[int]], params: SamplingParams) -> tuple[dict[str, list[int]], int]:
    """Drive the engine step by step: (tokens by request id, preemptions seen). The first prompt
    runs a step alone, so that the others find its blocks in the prefix cache."""
    llm.engine.add_request("0", prompts[0], params)
    llm.engine.step()
    for index, prompt in enumerate(prompts[1:], start=1):
        llm.engine.add_request(str(index), prompt, params)
    tokens, preemptions = {}, 0
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        preemptions += llm.engine.last_step.num_preemptions if llm.engine.last_step else 0
    return tokens, preemptions


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_prefix_caching_keep_the_tokens(mode, tiny_llama_dir):
    shared = list(range(2000, 2040))  # 2.5 blocks of 16 shared by every prompt
    prompts = [shared + [index, index + 7] for index in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with engine(tiny_llama_dir, block_size=16) as llm:
        want, _ = _run_steps(llm, prompts, params)
    # 20 blocks of 16 tokens cannot hold six sequences of 82 tokens at once: requests get preempted
    with engine(
        tiny_llama_dir, tensor_parallel_size=2, block_size=16, num_kv_blocks=20, preemption_mode=mode
    ) as llm:
        got, preemptions = _run_steps(llm, prompts, params)
        hits = llm.engine.kv_cache_manager.prefix_cache_hits
    assert preemptions > 0 and hits >= 32 * 5  # the shared full blocks, for every prompt after the first
    assert got == want


def test_ngram_speculation_under_tensor_parallelism(tiny_llama_dir):
    params = REPEATING
    with engine(tiny_llama_dir) as llm:
        reference = llm.generate(PROMPTS, params, use_tqdm=False)
    kwargs = dict(speculative_method="ngram", speculative_disable_batch_size=0)
    with engine(tiny_llama_dir, tensor_parallel_size=2, **kwargs) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        accepted = llm.engine.spec_decode_stats.num_accepted_tokens
        workers = llm.engine.executor.launcher.processes
    assert accepted > 0
    assert [worker.exitcode for worker in workers] == [0]  # shutdown stopped it cleanly
    for want, got in zip(reference, outputs, strict=True):
        assert_same_greedy(want, got)


def test_a_worker_that_dies_fails_the_step_with_the_rank_named(tiny_llama_dir):
    with engine(tiny_llama_dir, tensor_parallel_size=2) as llm:
        with pytest.raises(TensorParallelError, match="already runs a tensor-parallel engine"):
            LLM(tiny_llama_dir, tensor_parallel_size=2, **ENGINE_KWARGS)  # one group per process
        llm.engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
        llm.engine.step()
        worker = llm.engine.executor.launcher.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(30)
        for _ in range(2):  # and every step after it: the group cannot be resynchronized
            with pytest.raises(
                TensorParallelError, match=r"tensor-parallel rank 1 \(pid \d+\) exited with code -9"
            ):
                llm.engine.step()


def test_the_throughput_bench_runs_under_tensor_parallelism_and_refuses_naive_batching(tiny_llama_dir):
    """`bench throughput` warms up and times only the engine under TP; naive batching, which drives
    one process's model (a shard whose collectives no other rank joins), is a one-line error."""
    requests = [BenchRequest("", list(prompt), 4) for prompt in PROMPTS]
    with engine(tiny_llama_dir, tensor_parallel_size=2) as llm:
        with pytest.raises(ValueError, match="--naive-batch-sizes none"):
            run_throughput(llm, requests, [2])
        continuous, naive = run_throughput(llm, requests, [])
    assert continuous.output_tokens == 4 * len(PROMPTS) and naive == []
