"""Prefix caching, swap/recompute preemption and n > 1 sharing never change greedy tokens
(real model, float32)."""

import pytest

from llmserve import LLM, SamplingParams

from .conftest import long_text

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def shared_prefix_prompts(default_tokenizer) -> list[list[int]]:
    system = default_tokenizer.encode(long_text(150))  # a long shared "system prompt"
    questions = ["What is this about?", "Summarize it.", "Name one function.", "Is it long?"]
    return [system + default_tokenizer.encode(" " + q) for q in questions]


def test_prefix_cache_hit_and_miss_give_the_same_tokens(shared_prefix_prompts):
    uncached = LLM(dtype="float32", quantization="none", kv_cache_memory="128MiB", prefix_caching=False)
    expected = [
        o.outputs[0].token_ids for o in uncached.generate(shared_prefix_prompts, GREEDY, use_tqdm=False)
    ]

    cached = LLM(dtype="float32", quantization="none", kv_cache_memory="128MiB")
    first = cached.generate(shared_prefix_prompts[:1], GREEDY, use_tqdm=False)  # a miss: fills the cache
    rest = cached.generate(shared_prefix_prompts[1:], GREEDY, use_tqdm=False)  # hits on the prefix
    kv = cached.engine.kv_cache_manager
    assert kv.prefix_cache_hits >= 3 * 144  # at least 9 blocks of the shared prefix per later request
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    again = cached.generate(shared_prefix_prompts, GREEDY, use_tqdm=False)  # whole prompts cached
    assert [o.outputs[0].token_ids for o in again] == expected


@pytest.mark.full
def test_multi_turn_chat_reuses_the_first_turn(default_tokenizer):
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory="128MiB")
    turn1 = [{"role": "user", "content": long_text(80)}]
    reply = llm.chat(turn1, GREEDY, use_tqdm=False)[0].outputs[0].text
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter."}]
    hits_before = llm.engine.kv_cache_manager.prefix_cache_hits
    llm.chat(turn2, GREEDY, use_tqdm=False)
    first_turn_tokens = len(default_tokenizer.apply_chat_template(turn1))
    block = llm.engine.config.cache.block_size
    assert llm.engine.kv_cache_manager.prefix_cache_hits - hits_before >= (first_turn_tokens // block) * block


@pytest.mark.full
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_in_each_mode_gives_the_same_tokens(mode, default_tokenizer):
    prompts = [default_tokenizer.encode(long_text(40 + 30 * i)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = LLM(dtype="float32", quantization="none", kv_cache_memory="128MiB", prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    num_blocks = sum(-(-(len(p) + 1) // 16) for p in prompts) + 1  # all admitted; growth won't fit
    tight = LLM(
        dtype="float32",
        quantization="none",
        block_size=16,
        num_kv_blocks=num_blocks,
        prefix_caching=False,
        preemption_mode=mode,
    )
    outputs = tight.generate(prompts, params, use_tqdm=False)
    scheduler = tight.engine.scheduler
    assert scheduler.preemptions_by_mode[mode] > 0
    if mode == "swap":
        assert scheduler.num_swapped_out_blocks > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert tight.engine.kv_cache_manager.pool.num_free_blocks == num_blocks


@pytest.mark.full
def test_n_parallel_samples_equal_n_separate_seeded_requests(llm_fp32, default_tokenizer):
    prompt = default_tokenizer.encode(long_text(30))  # not a multiple of the block size
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
    together = llm_fp32.generate([prompt], params, use_tqdm=False)[0]
    separate = llm_fp32.generate([prompt] * 3, [params.child(i) for i in range(3)], use_tqdm=False)
    assert [c.token_ids for c in together.outputs] == [o.outputs[0].token_ids for o in separate]
    assert len({tuple(c.token_ids) for c in together.outputs}) > 1  # different seeds, different samples
