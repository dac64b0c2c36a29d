"""Gemma 2 and Gemma 3 with the KV of their sliding layers bounded by the window (KV-cache groups):
transformers' greedy tokens in float32 with prompt plus output past the window and the prefill's
chunks crossing its edge; a sliding group's blocks per request stay within ceil(W / B) + 1 while the
global group's grow; less of the pool used than with full KV in the sliding layers; prefix caching,
preemption and ngram speculation give the plain run's tokens; the per-group invariants hold."""

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.core.kv_cache_manager import NULL_BLOCK, cdiv
from tests.e2e.conftest import hf_greedy

from .families import VOCAB, make_family_dir

WINDOW, BLOCK, CHUNK = 16, 4, 12  # the cases' window; prompt chunks of 12 cross its edge
GEMMAS = ["gemma2-softcap-interleaved-window", "gemma3-qk-norm-local-rope"]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module", params=GEMMAS)
def gemma(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    return path, make_family_dir(path, request.param)


def _llm(path: str, **options) -> LLM:
    settings = dict(
        dtype="float32",
        max_model_len=128,
        block_size=BLOCK,
        kv_cache_memory="1MiB",
        max_num_batched_tokens=CHUNK,
        check_invariants=True,
    )
    return LLM(path, **{**settings, **options})


def _prompt(seed: int, length: int = 30) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _live(table: list[int]) -> int:
    return sum(block != NULL_BLOCK for block in table)


@pytest.mark.parametrize("backend", ["torch", "auto"])  # auto: Gemma 3 on the compiled paged kernel
def test_greedy_equals_transformers_with_bounded_sliding_blocks(gemma, backend):
    path, hf = gemma
    llm = _llm(path, attention_backend=backend)
    try:
        engine, kv = llm.engine, llm.engine.kv_cache_manager
        groups = engine.config.cache.kv_groups
        compiled = backend == "auto" and "gemma3" in path  # Gemma 2's soft-cap keeps the reference
        assert engine.model_runner.attention_backend.name == ("cpu_paged" if compiled else "torch")
        assert [group.window for group in groups] == [0, WINDOW, WINDOW]  # layers 1 | 0 | 2
        prompt = _prompt(1)
        engine.add_request("a", prompt, GREEDY)
        outputs, peak_sliding, peak_global = [], 0, 0
        while engine.has_unfinished_requests():
            outputs.extend(engine.step())
            if "a" not in kv.block_tables.by_request:
                continue
            computed = engine.scheduler.running[0].num_computed_tokens
            sliding = max(_live(kv.block_tables.group("a", g)) for g in (1, 2))
            # a prefill chunk writes CHUNK positions beside the window; a decode only its window's
            chunk = CHUNK if computed <= len(prompt) else 1
            assert sliding <= cdiv(WINDOW - 1 + chunk, BLOCK) + 1
            if computed > len(prompt):
                assert sliding <= cdiv(WINDOW, BLOCK) + 1 == kv.groups[1].max_blocks
            peak_sliding = max(peak_sliding, sliding)
            peak_global = max(peak_global, _live(kv.block_tables.group("a", 0)))
        assert outputs[-1].outputs[0].token_ids == hf_greedy(hf, prompt, 40)
        # the global group held (nearly) the whole sequence: 30 + 40 tokens, the last one never fed back
        assert peak_sliding <= cdiv(WINDOW - 1 + CHUNK, BLOCK) + 1 < cdiv(64, BLOCK) <= peak_global
        assert kv.block_tables.num_window_evicted_blocks > 0 and engine.invariants.violations == 0
    finally:
        llm.shutdown()


def test_pool_usage_is_lower_than_with_full_kv_in_sliding_layers(gemma):
    path, hf = gemma
    prompts = [_prompt(seed, 40) for seed in range(3)]
    peaks, tokens, blocks = {}, {}, {}
    for bounded in (True, False):
        llm = _llm(path, disable_hybrid_kv_cache_manager=not bounded)
        try:
            engine = llm.engine
            for index, prompt in enumerate(prompts):
                engine.add_request(str(index), prompt, GREEDY)
            peak, done = 0.0, {}
            while engine.has_unfinished_requests():
                for output in engine.step():
                    done[output.request_id] = output.outputs[0].token_ids
                peak = max(peak, engine.kv_cache_manager.usage)
            peaks[bounded], tokens[bounded] = peak, [done[str(i)] for i in range(3)]
            blocks[bounded] = engine.config.cache.num_blocks
            assert engine.invariants.violations == 0
        finally:
            llm.shutdown()
    assert blocks[True] // 3 == blocks[False]  # a block holds one layer of a group, not all three
    assert tokens[True] == tokens[False] == [hf_greedy(hf, p, 40) for p in prompts]
    # 80 tokens a request: full KV takes 3 layers x 20 blocks; bounded, 20 global + 2 x at most 5 sliding
    assert peaks[True] < 0.6 * peaks[False]


def test_prefix_cache_preemption_and_ngram_keep_the_plain_runs_tokens(gemma):
    path, hf = gemma
    shared = _prompt(7, 28)
    prompts = [shared + _prompt(8, 6), shared + _prompt(9, 5), _prompt(10, 33)]
    expected = [hf_greedy(hf, prompt, 40) for prompt in prompts]
    llm = _llm(path)
    try:  # one at a time: the second and a repeat of the first hit the prefix cache
        outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts + prompts[:1]]
        assert [o.outputs[0].token_ids for o in outputs] == expected + expected[:1]
        assert outputs[1].num_cached_tokens == 28 and outputs[3].num_cached_tokens == 32
        assert llm.engine.invariants.violations == 0
    finally:
        llm.shutdown()
    # a pool of 40 blocks for three requests of ~20 global + ~10 sliding blocks each: preemption
    llm = _llm(path, num_kv_blocks=40, preemption_mode="recompute")
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.invariants.violations == 0
    finally:
        llm.shutdown()
    repeats = _prompt(11, 8) * 4  # ngram drafts from the repeats; rejected ones roll back per group
    llm = _llm(path, speculative_method="ngram", num_speculative_tokens=3)
    try:
        (output,) = llm.generate([repeats], GREEDY, use_tqdm=False)
        assert output.outputs[0].token_ids == hf_greedy(hf, repeats, 40)
        assert llm.engine.invariants.violations == 0
    finally:
        llm.shutdown()
