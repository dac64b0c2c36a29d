"""The benchmarks' engine paths on a tiny random Llama: same greedy tokens, exact token accounting."""

import threading
import time

import pytest
import torch

from llmserve.benchmarks.latency import measure_bounds, model_size, run_latency
from llmserve.benchmarks.memory import live_engine_args, measure_live, sample_cache
from llmserve.benchmarks.naive_batching import NaiveBatchRunner
from llmserve.benchmarks.throughput import run_continuous, run_throughput
from llmserve.benchmarks.workload import TokenCorpus, WorkloadSpec, build_workload, greedy_params
from llmserve.config import EngineArgs

SPEC = WorkloadSpec(num_requests=7, seed=0, prompt_len_median=12, output_len_median=6,
                    prompt_len_range=(2, 40), output_len_range=(1, 12))  # fmt: skip


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    from llmserve import LLM

    # A small step budget chunks the longer prompts: the engine's schedule differs from naive's.
    return LLM(tiny_model_dir, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def workload(tiny_llm):
    return build_workload(SPEC, tiny_llm.tokenizer)


def test_naive_batching_and_continuous_batching_give_the_same_greedy_tokens(tiny_llm, workload):
    continuous, naive = run_throughput(tiny_llm, workload, batch_sizes=[1, 3, 7])
    expected_output = sum(r.max_tokens for r in workload)
    assert continuous.output_tokens == expected_output
    assert continuous.prompt_tokens == sum(r.prompt_len for r in workload)
    for result in naive:
        assert result.matching_outputs == len(workload), result.system
        assert (result.requests, result.output_tokens) == (len(workload), expected_output)
    # One group of all 7: every row padded to the longest prompt, decoding until the longest output.
    longest_prompt = max(r.prompt_len for r in workload)
    longest_output = max(r.max_tokens for r in workload)
    assert naive[-1].computed_tokens == 7 * longest_prompt + 7 * (longest_output - 1)
    # Alone (B=1) nothing is padded and no row waits.
    assert naive[0].computed_tokens == sum(r.prompt_len + r.max_tokens - 1 for r in workload)


def test_deterministic_naive_batches_prefill_in_place_and_all_match(tiny_model_dir, workload):
    """Under --deterministic the naive runner's padded prompts go through the paged kernel as the
    engine's chunks do (not the prefill kernel), so every output is the continuous engine's."""
    from llmserve import LLM

    llm = LLM(
        tiny_model_dir,
        dtype="float32",
        kv_cache_memory="16MiB",
        max_num_batched_tokens=32,
        deterministic=True,
    )
    _, naive = run_throughput(llm, workload, batch_sizes=[3, 7])
    assert [result.matching_share for result in naive] == [1.0, 1.0]
    runner = NaiveBatchRunner(llm.engine.model_runner.model)
    assert runner.max_in_place_span > max(r.prompt_len for r in workload)


def test_naive_batching_feeds_the_reference_backend_too(tiny_model_dir, workload):
    """The module's engine picks the compiled in-place backend (block tables) where it builds; the
    reference backend reads gathered slots and a mask instead: naive batching must serve both."""
    from llmserve import LLM

    llm = LLM(
        tiny_model_dir, dtype="float32", kv_cache_memory="4MiB", block_size=4, attention_backend="torch"
    )
    _, naive = run_throughput(llm, workload[:4], batch_sizes=[4])
    assert naive[0].matching_outputs == 4


def test_naive_batching_writes_the_engines_8_bit_rows_and_refuses_low_bit_caches(
    tiny_model_dir, workload, tmp_path
):
    """Its buffer takes the engine's KV format: int8 rows carry their scale (the same tokens as the
    engine, within the int8 cache's rounding); int4/int2 rows need windows it does not keep."""
    from llmserve import LLM

    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype="int8")
    _, naive = run_throughput(llm, workload[:4], batch_sizes=[4])
    assert naive[0].requests == 4 and naive[0].matching_outputs >= 3
    from tests.helpers import make_tiny_llama_dir

    model_32 = make_tiny_llama_dir(str(tmp_path / "head32"), head_dim=32, num_attention_heads=2)
    low_bit = LLM(model_32, dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="naive batching does not write int4/int2"):
        run_throughput(low_bit, workload[:4], batch_sizes=[4])
    continuous, naive = run_throughput(low_bit, workload[:4], batch_sizes=[])
    assert continuous.output_tokens == sum(r.max_tokens for r in workload[:4]) and naive == []


def test_naive_runner_returns_the_engine_cache_to_the_model(tiny_llm, workload):
    model = tiny_llm.engine.model_runner.model
    before = [(layer.key_cache, layer.value_cache) for layer in model.attention_layers()]
    tokens, _ = NaiveBatchRunner(model).generate([r.prompt_token_ids for r in workload[:2]], [3, 2], 2)
    assert [len(t) for t in tokens] == [3, 2]
    after = [(layer.key_cache, layer.value_cache) for layer in model.attention_layers()]
    assert all(a is c and b is d for (a, b), (c, d) in zip(before, after, strict=True))
    _, again = run_continuous(tiny_llm, workload[:2])
    reference = tiny_llm.generate(
        [r.prompt_token_ids for r in workload[:2]], [greedy_params(r.max_tokens) for r in workload[:2]]
    )
    assert again == [o.outputs[0].token_ids for o in reference]


def test_latency_runs_leave_the_engine_empty_and_bounds_count_the_weights(tiny_llm):
    engine = tiny_llm.engine
    points = run_latency(engine, TokenCorpus(tiny_llm.tokenizer), [4, 16], decode_tokens=3, repeats=2)
    assert [p.prompt_len for p in points] == [4, 16]
    assert all(p.prefill_seconds > 0 and p.decode_seconds_per_token > 0 for p in points)
    assert not engine.has_unfinished_requests()
    model = engine.model_runner.model
    bounds = measure_bounds(model, torch.device("cpu"), copy_bytes=2**20, matmul_size=64, repeats=1)
    num_parameters, weight_bytes = model_size(model)
    assert num_parameters == sum(p.numel() for p in model.parameters())
    assert (bounds.num_parameters, bounds.weight_bytes) == (num_parameters, 4 * num_parameters)  # float32
    assert bounds.floor_ms_per_token == pytest.approx(1e3 * weight_bytes / bounds.copy_bandwidth)
    assert bounds.read_floor_ms_per_token == pytest.approx(1e3 * weight_bytes / bounds.read_bandwidth)
    assert bounds.compute_ceiling_tok_s == pytest.approx(bounds.matmul_flops / (2 * num_parameters))


def test_live_memory_sampling_counts_blocks_and_computed_tokens(tiny_model_dir, workload):
    from llmserve.engine.llm_engine import LLMEngine

    args = EngineArgs(model=tiny_model_dir, dtype="float32", num_kv_blocks=12, block_size=4, max_num_seqs=2)
    engine = LLMEngine(live_engine_args(args, len(workload)))
    assert engine.config.scheduler.max_num_seqs == len(workload)
    assert not engine.config.cache.enable_prefix_caching
    for index, request in enumerate(workload[:3]):
        engine.add_request(str(index), request.prompt_token_ids, greedy_params(request.max_tokens))
    engine.step()
    sample = sample_cache(engine)
    running = engine.scheduler.running
    assert sample.num_running == len(running) > 0
    assert sample.used_slots == sum(r.num_computed_tokens for r in running)
    assert 0 <= sample.allocated_slots - sample.used_slots < 4 * len(running)  # under a block each
    while engine.has_unfinished_requests():
        engine.step()
    live = measure_live(engine, workload)
    assert 1 <= live.max_running <= len(workload) and 0.0 <= live.mean_waste < 1.0
    assert not engine.has_unfinished_requests()


def test_waiting_for_the_kv_prefault_joins_the_thread(tiny_llm, monkeypatch):
    """Benchmarks time nothing while the background prefault still runs (it would take a core)."""
    runner = tiny_llm.engine.model_runner
    # the case under test: a prefault still running when the wait begins (a sleep stands for its work)
    slow_prefault = threading.Thread(target=time.sleep, args=(0.3,))
    slow_prefault.start()
    monkeypatch.setattr(runner, "kv_prefault", slow_prefault)
    runner.wait_for_kv_prefault()
    assert not slow_prefault.is_alive()


def test_bounds_count_what_a_decode_step_reads_for_quantized_and_untied_weights():
    from torch import nn

    from llmserve.quantization.formats import quantize_int8
    from llmserve.quantization.kernels import QuantizedLinear

    class Untied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 64)  # a lookup: a step reads one row, not the table
            self.norm = nn.LayerNorm(64)
            self.proj = QuantizedLinear(quantize_int8(torch.randn(96, 64)), None, torch.float32, "cpu")
            self.head = nn.Linear(64, 100, bias=False)

    model = Untied()
    kernel_bytes = sum(b.numel() * b.element_size() for b in model.proj.kernel.buffers() if b is not None)
    num_parameters, weight_bytes = model_size(model)
    assert num_parameters == 96 * 64 + 2 * 64 + 64 * 100
    # every quantized byte counted at most once (a kernel's small-batch copy instead of its other layout)
    assert 96 * 64 <= weight_bytes - 4 * (2 * 64 + 64 * 100) <= kernel_bytes
    tied = Untied()
    tied.head.weight = tied.embed.weight  # tied: the table is the output projection, read whole, once
    assert model_size(tied) == (num_parameters + 64 * 100 - 64 * 100, weight_bytes)


@pytest.mark.cpu_kernels("bf16_linear")
def test_bounds_count_a_bf16_layers_packed_copy_when_its_weight_is_freed():
    """A bf16 layer whose packed copy is its only one (kernels/small_batch_linear.py) still counts:
    its weights and the copy's bytes, once per copy (a tied head's shared with the embedding)."""
    from torch import nn

    from llmserve.kernels.small_batch_linear import use_small_batch_linear

    model = nn.ModuleDict({"norm": nn.LayerNorm(64), "proj": nn.Linear(64, 96, bias=False)}).bfloat16()
    counted = model_size(model)
    assert use_small_batch_linear(model, amx=False) == 1 and model["proj"].weight is None
    assert model_size(model) == counted == (96 * 64 + 2 * 64, 2 * (96 * 64 + 2 * 64))
