"""The same greedy tokens whatever the schedule: chunked or not, preempted or not, alone or batched."""

import pytest

from llmserve import LLM, SamplingParams

from .conftest import long_text

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm_fp32, prompts_5_to_600):
    """Whole prompts in one step each (no chunking), a pool large enough never to preempt."""
    outputs = llm_fp32.generate(prompts_5_to_600, GREEDY, use_tqdm=False)
    assert llm_fp32.engine.scheduler.num_preemptions == 0
    return [o.outputs[0].token_ids for o in outputs]


def test_chunked_prefill_with_a_tiny_token_budget(prompts_5_to_600, reference):
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory="256MiB", max_num_batched_tokens=61)
    outputs = llm.generate(prompts_5_to_600, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference


@pytest.mark.full
def test_chunked_prefill_off(prompts_5_to_600, reference):
    llm = LLM(
        dtype="float32",
        quantization="none",
        kv_cache_memory="256MiB",
        max_num_batched_tokens=4096,
        enable_chunked_prefill=False,
        max_model_len=4096,
    )
    outputs = llm.generate(prompts_5_to_600, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference


def test_preemption_forced_by_a_tiny_kv_pool(llm_fp32, default_tokenizer):
    """A pool that admits every prompt at once but cannot hold their growth forces preemptions."""
    prompts = [default_tokenizer.encode(long_text(60 + 17 * i)) for i in range(6)]
    expected = [o.outputs[0].token_ids for o in llm_fp32.generate(prompts, GREEDY, use_tqdm=False)]
    num_blocks = sum(-(-(len(p) + 1) // 16) for p in prompts) + 1  # of 16 tokens
    llm = LLM(
        dtype="float32",
        quantization="none",
        block_size=16,
        num_kv_blocks=num_blocks,
        prefix_caching=False,
        preemption_mode="recompute",
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    llm.engine.kv_cache_manager.check_integrity()
    assert llm.engine.kv_cache_manager.pool.num_free_blocks == num_blocks


def test_one_prompt_alone_equals_the_same_prompt_in_a_batch_of_32(llm_fp32, default_tokenizer):
    prompts = [default_tokenizer.encode(long_text(8 + 6 * i)) for i in range(32)]
    batched = llm_fp32.generate(prompts, GREEDY, use_tqdm=False)
    for index in (0, 13, 31):
        alone = llm_fp32.generate([prompts[index]], GREEDY, use_tqdm=False)
        assert alone[0].outputs[0].token_ids == batched[index].outputs[0].token_ids


@pytest.mark.full
@pytest.mark.parametrize("lookup_max", [4, 0])
def test_the_shipped_draft_head_on_the_default_model(prompts_5_to_600, reference, lookup_max):
    """The head shipped for the default model recognizes it (in float32),
    its drafts are often right on these prompts it never saw, and the tokens are plain greedy's."""
    llm = LLM(
        dtype="float32",
        quantization="none",
        kv_cache_memory="256MiB",
        speculative_method="draft_head",
        prompt_lookup_max=lookup_max,
        speculative_disable_batch_size=0,
    )
    outputs = llm.generate(prompts_5_to_600, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    stats = llm.engine.spec_decode_stats
    assert stats.num_draft_tokens > 20
    assert stats.acceptance_rate > 0.15


@pytest.mark.full
def test_latency_targets_change_when_prompt_tokens_are_computed_never_which_tokens(
    prompts_5_to_600, reference
):
    """Prompts arrive while others decode, and a cost model with dear prefill (1 ms a token) chops them
    into chunks of what the decodes' 50 ms TPOT target leaves: the same greedy tokens as whole prompts."""
    from collections import defaultdict

    from llmserve.core.step_cost import StepCostModel

    llm = LLM(
        dtype="float32",
        quantization="none",
        kv_cache_memory="256MiB",
        ttft_target_ms=60_000,
        tpot_target_ms=50,
    )
    engine = llm.engine
    engine.scheduler.cost_model = StepCostModel.fixed((0.01, 0.001, 0.001, 0.0, 0.0))
    chunks, schedule = defaultdict(list), engine.scheduler.schedule

    def recording(*args, **kwargs):
        output = schedule(*args, **kwargs)
        for request in output.requests:
            if request.first_token_time is None:
                chunks[request.request_id].append(output.plan.num_scheduled_tokens[request.request_id])
        return output

    engine.scheduler.schedule = recording
    for index in range(2):
        engine.add_request(str(index), prompts_5_to_600[index], GREEDY)
    finished = {}
    for step in range(10**4):
        if step == 3:  # the first two decode by now; the rest arrive
            for index in range(2, len(prompts_5_to_600)):
                engine.add_request(str(index), prompts_5_to_600[index], GREEDY)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        if step > 3 and not engine.has_unfinished_requests():
            break
    assert [finished[str(i)] for i in range(len(prompts_5_to_600))] == reference
    # the longest prompt goes first (the least TTFT slack), in chunks; the others share its prefix
    longest = max(range(len(prompts_5_to_600)), key=lambda index: len(prompts_5_to_600[index]))
    assert len(chunks[str(longest)]) >= 2 and max(chunks[str(longest)]) < len(prompts_5_to_600[longest])
