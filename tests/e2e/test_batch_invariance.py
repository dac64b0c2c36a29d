"""Batch invariance (--deterministic, worker/batch_invariance.py): the same prompts greedy-decoded alone,
batched with other prompts, in chunks of several sizes, with and without prefix-cache hits, preempted
and resumed, and verified as speculative drafts give bitwise-equal token ids and logprobs.

A random Llama of two layers with the default model's widths (oneDNN's GEMM sums inputs of fewer
columns in the compiled kernels' order) and a small vocabulary, in float32 and bf16. Its prompts are
long enough for the default kernels to differ: above 8 rows a float32 layer took oneDNN's GEMM on
AVX-512 CPUs, above 16 queries a span the prefill kernel, above 256 rows a bf16 layer oneDNN's GEMM
(tests/kernels/test_batch_invariance.py checks each kernel). Without --deterministic the batched and
the chunked tests fail on an AVX-512 machine (its logprobs differ in their last bits).
"""

from __future__ import annotations

import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.entrypoints.openai.server_info import server_info
from tests.helpers import make_tiny_llama_dir

pytestmark = pytest.mark.cpu_kernels

GREEDY_ARGS = dict(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
GREEDY = SamplingParams(**GREEDY_ARGS)
DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.full)]  # full: the same in float32


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_llama_dir(
        str(tmp_path_factory.mktemp("models") / "tiny-llama"),
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=8192,
    )


def make_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 3 to 300 tokens; each repeats a stretch of itself (prompt lookup then drafts), and
    pairs share a 64-token prefix (two blocks: prefix-cache hits within one batch)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 5000) for _ in range(64)]
    prompts = []
    for index in range(count):
        length = 3 + (index * 97) % 298
        body = [rng.randrange(10, 5000) for _ in range(length)]
        body[length // 2 :] = body[: length - length // 2]
        prompts.append(prefix + body if index % 3 == 1 else body)
    return prompts


def engine(tiny_dir: str, dtype: str, **kwargs) -> LLM:
    options = dict(dtype=dtype, max_model_len=512, kv_cache_memory="32MiB", deterministic=True)
    return LLM(tiny_dir, **{**options, **kwargs})


def results(outputs) -> list[tuple[list[int], list[dict[int, float]]]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.fixture(scope="module", params=DTYPES)
def alone(request, tiny_dir):
    """Each prompt alone, whole in one step, with nothing cached: the reference."""
    dtype, prompts = request.param, make_prompts(8)
    llm = engine(tiny_dir, dtype, prefix_caching=False, max_num_batched_tokens=512)
    expected = [results(llm.generate([prompt], GREEDY, use_tqdm=False))[0] for prompt in prompts]
    return dtype, prompts, expected


def test_batched_with_other_prompts(tiny_dir, alone):
    dtype, prompts, expected = alone
    llm = engine(tiny_dir, dtype, prefix_caching=False, max_num_batched_tokens=4096, max_model_len=512)
    assert results(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert results(llm.generate(prompts[1:3], GREEDY, use_tqdm=False)) == expected[1:3]  # a batch of 2
    info = server_info("tiny", llm.engine.config, llm.engine.tokenizer, None, llm.engine.batch_invariance)
    assert info.batch_invariant and info.batch_invariance_reasons == []


@pytest.mark.full  # tests/kernels/test_batch_invariance.py checks the sampler's seeded rows in the fast tier
def test_seeded_sampling_among_other_requests(tiny_dir, alone):
    """Seeded requests at temperature > 0 with top-k and top-p draw the same tokens (and logprobs) alone
    and chunked among greedy and unseeded sampled requests that need more top-k candidates."""
    dtype, prompts, _ = alone
    sampled = dict(temperature=0.9, top_k=40, top_p=0.9, max_tokens=8, ignore_eos=True, logprobs=2)
    seeded = [SamplingParams(seed=index, **sampled) for index in range(3)]
    llm = engine(tiny_dir, dtype, prefix_caching=False, max_num_batched_tokens=512)
    expected = [results(llm.generate([prompts[i]], seeded[i], use_tqdm=False))[0] for i in range(3)]
    unseeded = SamplingParams(temperature=1.0, top_k=300, top_p=0.95, max_tokens=8, ignore_eos=True)
    mixed = engine(tiny_dir, dtype, max_num_batched_tokens=37)
    params = seeded + [GREEDY, unseeded] * ((len(prompts) - 3) // 2) + [GREEDY] * ((len(prompts) - 3) % 2)
    assert results(mixed.generate(prompts, params, use_tqdm=False))[:3] == expected


@pytest.mark.full  # the same property as test_batched_with_other_prompts, at 64 rows a decode step
def test_a_batch_of_64(tiny_dir, alone):
    """Each prompt 8 times over, its copies computed apart (no prefix cache): every copy decodes alike."""
    dtype, prompts, expected = alone
    llm = engine(tiny_dir, dtype, prefix_caching=False, max_num_batched_tokens=4096, kv_cache_memory="128MiB")
    assert results(llm.generate(prompts * 8, GREEDY, use_tqdm=False)) == expected * 8


def test_rows_with_lora_adapters(tiny_dir, alone, tmp_path):
    """Two adapters and the base model mixed in one batch, chunked: each row what it gets alone (the
    compiled delta computes each row alone; /server_info names nothing)."""
    from tests.lora.adapters import ADAPTERS, make_adapter

    dtype, prompts, _ = alone
    modules = []
    for seed, name in enumerate(("qv", "all")):
        make_adapter(tiny_dir, str(tmp_path / name), seed + 1, **ADAPTERS[name])
        modules.append(f"{name}={tmp_path / name}")
    options = dict(enable_lora=True, lora_modules=modules, max_loras=2, prefix_caching=False)
    params = [
        SamplingParams(**{**GREEDY_ARGS, "lora_name": (None, "qv", "all")[i % 3]})
        for i in range(len(prompts))
    ]
    llm = engine(tiny_dir, dtype, max_num_batched_tokens=512, **options)
    expected = [
        results(llm.generate([p], q, use_tqdm=False))[0] for p, q in zip(prompts, params, strict=True)
    ]
    chunked = engine(tiny_dir, dtype, max_num_batched_tokens=37, **options)
    assert results(chunked.generate(prompts, params, use_tqdm=False)) == expected
    info = server_info("tiny", llm.engine.config, llm.engine.tokenizer, None, llm.engine.batch_invariance)
    assert info.batch_invariant and info.batch_invariance_reasons == []


def test_a_lora_layer_off_the_compiled_delta_is_named(tiny_dir):
    """A rank whose q/k/v stack is wider than the kernel takes: that layer's grouped matmuls are
    blocked by row count, and /server_info says so."""
    llm = engine(tiny_dir, "float32", enable_lora=True, max_lora_rank=171)
    info = server_info("tiny", llm.engine.config, llm.engine.tokenizer, None, llm.engine.batch_invariance)
    assert not info.batch_invariant
    assert info.batch_invariance_reasons == [
        "LoRA adapters: some deltas are torch matmuls, blocked by the step's row count"
    ]


def test_the_flag_on_the_command_line():
    import argparse

    from llmserve.config import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--deterministic"])).deterministic is True
    assert EngineArgs.from_cli_args(parser.parse_args(["--no-deterministic"])).deterministic is False
    assert EngineArgs.from_cli_args(parser.parse_args([])).deterministic is None  # the runner decides


def test_on_by_default_where_it_changes_attention_alone(tiny_dir, alone):
    """Unset, the flag is on for a bf16 model whose linear layers' kernels take every row count (no
    AMX tiles above 8 rows), and then the batched and chunked rows equal the reference's; a float32
    model keeps the prefill kernel (its long spans cost more in pieces) and says so."""
    dtype, prompts, expected = alone
    llm = engine(tiny_dir, dtype, deterministic=None, max_num_batched_tokens=37)
    info = server_info("tiny", llm.engine.config, llm.engine.tokenizer, None, llm.engine.batch_invariance)
    amx = any(getattr(module, "amx", False) for module in llm.engine.model_runner.model.modules())
    if dtype == "float32" or amx:
        assert not llm.engine.config.model.deterministic
        assert info.batch_invariance_reasons[0] == "--deterministic is off"
        assert any("prefill kernel" in reason for reason in info.batch_invariance_reasons)
        assert amx == any("AMX tiles" in reason for reason in info.batch_invariance_reasons)
        return
    assert llm.engine.config.model.deterministic is True
    assert info.batch_invariant and info.batch_invariance_reasons == []
    assert results(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert results(llm.generate(prompts[::-1], GREEDY, use_tqdm=False)) == expected[::-1]  # prefix hits


def test_server_info_names_what_is_not_invariant_and_the_flag_is_checked(tiny_dir):
    llm = engine(tiny_dir, "float32", deterministic=False)
    info = server_info("tiny", llm.engine.config, llm.engine.tokenizer, None, llm.engine.batch_invariance)
    assert info.batch_invariant is False
    assert info.batch_invariance_reasons[0] == "--deterministic is off"
    assert any("prefill kernel" in reason for reason in info.batch_invariance_reasons)
    assert server_info("tiny", llm.engine.config, llm.engine.tokenizer).batch_invariant is None  # unknown
    with pytest.raises(ValueError, match="cpu_paged"):
        engine(tiny_dir, "float32", attention_backend="torch")


@pytest.mark.parametrize(
    "budget", [pytest.param(5, marks=pytest.mark.full), 37, pytest.param(200, marks=pytest.mark.full)]
)
def test_chunked_prefill_and_prefix_hits(tiny_dir, alone, budget):
    """Prompts chunked by a step budget, decodes among their chunks; twice, the second time through the
    prefix cache (every full block of every prompt cached by the first)."""
    dtype, prompts, expected = alone
    llm = engine(tiny_dir, dtype, max_num_batched_tokens=budget)
    assert results(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    manager = llm.engine.kv_cache_manager
    hits = manager.prefix_cache_hits
    assert results(llm.generate(prompts[::-1], GREEDY, use_tqdm=False)) == expected[::-1]
    assert manager.prefix_cache_hits > hits


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.full)])
def test_preempted_and_resumed(tiny_dir, alone, mode):
    dtype, prompts, expected = alone
    num_blocks = sum(-(-(len(p) + 1) // 16) for p in prompts) + 1  # all admitted; their growth won't fit
    llm = engine(
        tiny_dir, dtype, block_size=16, num_kv_blocks=num_blocks, prefix_caching=False, preemption_mode=mode
    )
    assert results(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.scheduler.num_preemptions > 0


def test_speculative_decoding(tiny_dir, alone):
    dtype, prompts, expected = alone
    early_exit = dict(speculative_method="early_exit", speculative_draft_layers=1, num_speculative_tokens=3)
    llm = engine(tiny_dir, dtype, speculative_disable_batch_size=0, **early_exit)
    assert results(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.full  # the tiny model's tests check the same property in the fast tier
def test_the_default_model_in_its_default_dtype(prompts_5_to_600):
    """The embedded model in its default configuration (its GGUF's blocks, bf16 activations), where the
    flag is on by default: alone, batched, and chunked by a budget of 61 tokens, bitwise alike (without
    the flag, batching changed the tokens of some of these prompts on an AVX-512 BF16 machine)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    llm = LLM(kv_cache_memory="256MiB", prefix_caching=False)
    assert llm.engine.config.model.deterministic and llm.engine.batch_invariance == ()
    expected = [results(llm.generate([prompt], params, use_tqdm=False))[0] for prompt in prompts_5_to_600]
    assert results(llm.generate(prompts_5_to_600, params, use_tqdm=False)) == expected
    chunked = LLM(kv_cache_memory="256MiB", max_num_batched_tokens=61)
    assert results(chunked.generate(prompts_5_to_600, params, use_tqdm=False)) == expected
