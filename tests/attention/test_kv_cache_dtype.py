"""--kv-cache-dtype int8/fp8 in the engine: pool capacity, greedy agreement with the float cache,
scales that move with their blocks (swap, copy-on-write, speculative drafts), real-model perplexity."""

import pytest
import torch

from llmserve.config import EngineArgs, default_block_size
from llmserve.entrypoints.llm import LLM
from llmserve.model_loader import default_model_path, load_arch_config
from llmserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def smollm2_arch():
    """The default model's architecture (30 layers, 3 KV heads of 64), read from its file."""
    return load_arch_config(default_model_path())


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_8bit_pool_holds_1_94x_the_tokens_of_bf16_scales_included(kv_dtype, smollm2_arch):
    def blocks(kv_cache_dtype):
        args = EngineArgs(
            dtype="bfloat16", device="cpu", kv_cache_memory="1GiB", kv_cache_dtype=kv_cache_dtype
        )
        return args.create_config(smollm2_arch, "unused").cache

    bf16, quantized = blocks("auto"), blocks(kv_dtype)
    assert bf16.block_size == 32  # the CPU default
    assert bf16.num_blocks == 2**30 // (2 * 30 * 3 * 64 * 2 * 32)
    assert quantized.num_blocks == 2**30 // (2 * 30 * 3 * (64 + 2) * 32)  # codes + a float16 scale per row
    assert 1.93 <= quantized.num_blocks / bf16.num_blocks < 1.94  # 128 / 66
    assert quantized.kv_cache_memory <= 2**30 and quantized.kv_cache_dtype == kv_dtype


def test_block_size_defaults_to_32_tokens_on_a_cpu_16_on_a_gpu_and_a_given_one_wins(smollm2_arch):
    assert default_block_size(torch.device("cpu")) == 32
    assert default_block_size(torch.device("cuda")) == 16
    given = EngineArgs(dtype="bfloat16", device="cpu", block_size=16).create_config(smollm2_arch, "x").cache
    assert given.block_size == 16 and given.num_blocks == 2**30 // (2 * 30 * 3 * 64 * 2 * 16)
    with pytest.raises(ValueError, match="power of two"):
        EngineArgs(device="cpu", block_size=24).create_config(smollm2_arch, "x")


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "pool_bytes"),
    [("float32", "auto", 2 << 30), ("bfloat16", "auto", 1 << 30), ("float32", "int8", 1 << 30)],
)
def test_default_pool_holds_the_same_tokens_in_float32_and_bf16(dtype, kv_dtype, pool_bytes, smollm2_arch):
    """Without --kv-cache-memory the pool is 1 GiB for 16- and 8-bit entries and 2 GiB for float32
    ones; an explicit size always wins."""
    args = EngineArgs(dtype=dtype, device="cpu", kv_cache_dtype=kv_dtype)
    cache = args.create_config(smollm2_arch, "x").cache
    bytes_per_token = smollm2_arch.kv_bytes_per_token(getattr(torch, dtype), kv_dtype)
    assert cache.num_blocks == pool_bytes // (bytes_per_token * 32)
    if kv_dtype == "auto":
        assert cache.num_blocks == 2**30 // (2 * 30 * 3 * 64 * 2 * 32)  # 1,456 blocks either way
    explicit = EngineArgs(dtype=dtype, device="cpu", kv_cache_dtype=kv_dtype, kv_cache_memory="64MiB")
    assert explicit.create_config(smollm2_arch, "x").cache.num_blocks == (64 << 20) // (bytes_per_token * 32)


def test_unknown_kv_cache_dtype_is_a_one_line_error(smollm2_arch):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8, int4, int2"):
        EngineArgs(device="cpu", kv_cache_dtype="int3").create_config(smollm2_arch, "unused")


@pytest.fixture(scope="module")
def tiny(tiny_head32):
    return tiny_head32


PROMPTS = [
    list(range(start, start + length)) for start, length in ((100, 5), (900, 17), (3000, 40), (7000, 9))
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def generate(model, prompts=PROMPTS, params=GREEDY, **engine_args):
    llm = LLM(model=model, dtype="float32", **engine_args)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm


@pytest.mark.parametrize(("kv_dtype", "bound"), [("int8", 0.95), ("fp8", 0.7)])
def test_8bit_greedy_tokens_mostly_equal_the_float_cache(tiny, kv_dtype, bound):
    """Measure: teacher-forced agreement. Along each float-cache greedy continuation, the share of
    positions where the 8-bit cache's greedy token is the same (4 prompts x 24 positions). A random
    tiny model has near-ties (top-2 logit gaps of 0.02), so a few disagreements are expected; a
    broken cache agrees on almost none. Measured: int8 0.97, fp8 0.75 (3 mantissa bits)."""
    reference, _ = generate(tiny)
    prefixes = [p + r[:i] for p, r in zip(PROMPTS, reference, strict=True) for i in range(len(r))]
    one = SamplingParams(max_tokens=1, temperature=0)
    quantized, _ = generate(tiny, prompts=prefixes, params=one, kv_cache_dtype=kv_dtype)
    expected = [token for r in reference for token in r]
    agreement = sum(q == [e] for q, e in zip(quantized, expected, strict=True)) / len(expected)
    assert agreement >= bound, agreement


def test_scales_move_with_blocks_through_swap_and_copy_on_write(tiny):
    """Same int8 KV whether requests ran alone in a big pool or were swapped out and back in a tiny one,
    and parallel samples (n = 2, shared prompt blocks copied on write) too."""
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2, ignore_eos=True)
    common = dict(kv_cache_dtype="int8", block_size=4)
    roomy, _ = generate(tiny, params=params, **common)
    cramped, llm = generate(tiny, params=params, num_kv_blocks=16, preemption_mode="swap", **common)
    assert llm.engine.scheduler.preemptions_by_mode["swap"] > 0
    assert cramped == roomy


@pytest.mark.parametrize("method", ["early_exit", "draft"])
def test_speculative_decoding_over_an_int8_cache_keeps_greedy_output(tiny, method):
    plain, _ = generate(tiny, kv_cache_dtype="int8")
    draft = dict(speculative_draft_model=tiny) if method == "draft" else dict(speculative_draft_layers=1)
    speculated, llm = generate(
        tiny, kv_cache_dtype="int8", speculative_method=method, speculative_disable_batch_size=0, **draft
    )
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0
    assert speculated == plain


def test_real_model_perplexity_with_int8_kv_within_2_percent():
    from llmserve.benchmarks.kv_cache_ppl import perplexity
    from llmserve.corpus import corpus_text
    from llmserve.engine.llm_engine import LLMEngine

    results = {}
    for kv_dtype in ("auto", "int8"):
        engine = LLMEngine(EngineArgs(dtype="float32", kv_cache_dtype=kv_dtype, kv_cache_memory="64MiB"))
        ids = engine.tokenizer.encode(corpus_text()[:2000])[:256]
        results[kv_dtype] = perplexity(engine, ids, chunk=256)
    assert abs(results["int8"] / results["auto"] - 1) < 0.02, results
