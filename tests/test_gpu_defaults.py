"""GPU-sized defaults, resolved in the config layer without a GPU: the KV pool from
--gpu-memory-utilization and the measured device memory (injected here), 16-token blocks, vLLM's
scheduler limits; the CPU's defaults unchanged; bad fractions refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmserve.cli.main import main as cli_main
from llmserve.config import (
    DeviceMemory,
    EngineArgs,
    ModelArchConfig,
    default_kv_cache_memory,
    gpu_kv_cache_memory,
    profile_step_lengths,
)
from llmserve.engine import llm_engine
from llmserve.worker.gpu_memory import profile_plan, profile_runner
from tests.helpers import make_tiny_llama_dir

GIB = 2**30
ARCH = ModelArchConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
BF16_TOKEN_BYTES = 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads of 64, bf16


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def cuda_visible(monkeypatch):
    """A CUDA device as far as resolving the config goes (nothing here touches one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_cpu_defaults_are_unchanged():
    config = EngineArgs(device="cpu", dtype="bfloat16").create_config(ARCH, "model")
    assert config.cache.block_size == 32
    assert config.cache.num_blocks == (1 << 30) // (BF16_TOKEN_BYTES * 32)
    assert config.cache.size_from_gpu_memory is None
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs) == (2048, 128)


def test_cuda_defaults_wait_for_the_profile_on_the_profiling_steps_blocks(cuda_visible):
    config = EngineArgs(device="cuda").create_config(ARCH, "model")
    assert config.model.dtype == torch.bfloat16 and config.cache.block_size == 16
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs) == (8192, 256)
    assert config.cache.size_from_gpu_memory == 0.9
    # the step's 8192 tokens: a 4095-token prompt, a 3843-token one, 254 one-token rows
    assert config.cache.num_blocks == 256 + 241 + 254


def test_cuda_pool_gets_what_weights_and_peak_leave_of_the_fraction(cuda_visible):
    memory = DeviceMemory(total=80 * GIB, free=75 * GIB, weights=2 * GIB, peak_activations=1 * GIB)
    config = EngineArgs(device="cuda", gpu_memory_utilization=0.5).create_config(ARCH, "model", None, memory)
    block_bytes = BF16_TOKEN_BYTES * 16
    assert config.cache.num_blocks == (40 * GIB - 3 * GIB) // block_bytes
    assert config.cache.kv_cache_memory == config.cache.num_blocks * block_bytes
    assert config.cache.size_from_gpu_memory is None  # final


@pytest.mark.parametrize(
    ("size", "expected_blocks"),
    [(dict(kv_cache_memory="2GiB"), 2 * GIB // (BF16_TOKEN_BYTES * 16)), (dict(num_kv_blocks=100), 100)],
)
def test_an_explicit_pool_size_wins_on_cuda(cuda_visible, size, expected_blocks):
    memory = DeviceMemory(total=80 * GIB, free=75 * GIB, weights=2 * GIB, peak_activations=1 * GIB)
    for given in (None, memory):
        config = EngineArgs(device="cuda", **size).create_config(ARCH, "model", None, given)
        assert config.cache.num_blocks == expected_blocks
        assert config.cache.size_from_gpu_memory is None


def test_tensor_parallel_ranks_on_cuda_keep_the_fixed_default(cuda_visible):
    config = EngineArgs(device="cuda", tensor_parallel_size=3).create_config(ARCH, "model")
    per_rank_token_bytes = BF16_TOKEN_BYTES // 3  # one KV head of three
    assert config.cache.num_blocks == default_kv_cache_memory(torch.bfloat16) // (per_rank_token_bytes * 16)
    assert config.cache.size_from_gpu_memory is None


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_fraction_outside_zero_to_one_is_a_one_line_error(fraction):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]") as error:
        EngineArgs(device="cpu", gpu_memory_utilization=fraction).create_config(ARCH, "model")
    assert "\n" not in str(error.value)


def test_the_cli_refuses_a_bad_fraction_in_one_line(capsys):
    assert cli_main(["generate", "x", "--gpu-memory-utilization", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "llmserve: error: gpu_memory_utilization must be in (0, 1], got 1.5"


def test_memory_that_leaves_no_pool_is_refused():
    full = DeviceMemory(total=10 * GIB, free=9 * GIB, weights=8 * GIB, peak_activations=2 * GIB)
    with pytest.raises(ValueError, match="leave nothing for the KV cache"):
        gpu_kv_cache_memory(0.9, full)
    shared = DeviceMemory(total=10 * GIB, free=4 * GIB, weights=1 * GIB, peak_activations=1 * GIB)
    with pytest.raises(ValueError, match="other processes hold the rest"):
        gpu_kv_cache_memory(0.9, shared)  # asks 7 GiB of the 4 free
    assert gpu_kv_cache_memory(0.5, shared) == 3 * GIB


def test_profile_step_fills_the_budget_and_the_rows():
    assert profile_step_lengths(8192, 256, 4096) == [4095, 3843] + [1] * 254
    assert profile_step_lengths(8, 16, 100) == [1] * 8  # fewer tokens than rows
    assert profile_step_lengths(100, 4, 10) == [9, 9, 9, 9]  # each prompt as long as it may be


def _small_cpu_llm(tiny_model_dir, **kwargs):
    from llmserve import LLM

    return LLM(
        tiny_model_dir,
        device="cpu",
        dtype="float32",
        max_model_len=48,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        **kwargs,
    )


def test_the_profiling_step_runs_through_a_runner_of_its_own(tiny_model_dir):
    llm = _small_cpu_llm(tiny_model_dir, kv_cache_memory="4MiB")
    config = llm.engine.config
    plan = profile_plan(config)
    assert [len(r.prompt_token_ids) for r in plan.new_requests] == profile_step_lengths(64, 8, 48)
    output = profile_runner(config, llm.engine.model_runner.model).execute(plan)
    assert sorted(output.sampled_token_ids) == sorted(r.request_id for r in plan.new_requests)


def test_the_engine_sizes_its_pool_from_the_measured_memory(tiny_model_dir, monkeypatch):
    """The engine's path on a GPU, on the CPU: the profile step on its own pool, then the config
    resolved again from the memory (here stated, not measured) before the runner and KV manager."""
    token_bytes = 2 * 2 * 2 * 16 * 4  # the tiny model: 2 layers, 2 KV heads of 16, float32
    memory = DeviceMemory(total=64 << 20, free=60 << 20, weights=1 << 20, peak_activations=1 << 20)
    profiled = []

    def pool_blocks(self, device, dtype, parallel, block_bytes, device_memory):
        if device_memory is None:  # sized from the device once measured: the profiled step's blocks first
            return 0, self.gpu_memory_utilization
        return gpu_kv_cache_memory(self.gpu_memory_utilization, device_memory) // block_bytes, None

    def profile(config, model):
        profiled.append(config.cache.num_blocks)
        profile_runner(config, model).execute(profile_plan(config))
        return memory

    monkeypatch.setattr(EngineArgs, "_pool_blocks", pool_blocks)
    monkeypatch.setattr(llm_engine, "profile_device_memory", profile)
    llm = _small_cpu_llm(tiny_model_dir, gpu_memory_utilization=0.25)
    expected = (16 << 20) - (2 << 20)
    assert llm.engine.config.cache.num_blocks == expected // (token_bytes * 32)
    assert llm.engine.kv_cache_manager.num_blocks == llm.engine.config.cache.num_blocks
    assert profiled == [sum(-(-n // 32) for n in profile_step_lengths(64, 8, 48))]
    shape = llm.engine.model_runner.kv_cache.shape
    assert shape[2] == llm.engine.config.cache.num_blocks * 32
    from llmserve import SamplingParams

    (output,) = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


def test_configs_stay_frozen():
    config = EngineArgs(device="cpu").create_config(ARCH, "model")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.num_blocks = 1
