"""Each supported family against transformers in float32: logits of a chunked prefill, position by
position, and 32 greedy tokens (with a sliding window: prompt plus output longer than the window, the
prefill's chunks crossing its edge)."""

import pytest
import torch

from llmserve import LLM, SamplingParams
from tests.e2e.conftest import hf_greedy, teacher_forced_logits

from .families import CASES, VOCAB, make_family_dir

PROMPT_LEN = 40  # > the sliding windows (16) of the windowed cases
CHUNK = 12  # the prefill's chunk: 40 = 12 + 12 + 12 + 4, chunks crossing the window's edge


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_family_dir(path, request.param)
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=CHUNK,
        block_size=4,
        kv_cache_memory="8MiB",
    )
    yield request.param, hf, llm
    llm.shutdown()


def _prompt(seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunked_prefill_logits_match_transformers(family):
    _, hf, llm = family
    tokens = _prompt(1)
    ours = teacher_forced_logits(llm, tokens)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)


def test_32_greedy_tokens_equal_transformers(family):
    _, hf, llm = family
    prompts = [_prompt(2), _prompt(3)[:9]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, 32)


@pytest.mark.cpu_kernels("avx2")
def test_fused_decode_stack_serves_llama_layers_and_is_off_for_the_others(family):
    """The stack runs Llama's layer exactly (Llama, Mistral, Phi-3 with whole-head rope, Qwen3 with its
    head norms); every other family's runner has none, so its decode steps take the modules (never a
    stack that ignores a norm); float experts (Mixtral, Qwen3-MoE here) take the modules too."""
    case, _, llm = family
    runner = llm.engine.model_runner
    llm.generate([_prompt(4)[:5]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    if case.startswith(("llama", "mistral", "phi3-longrope-long", "qwen3-qk-norm", "qwen3-tied")):
        assert runner.model.fused_decode_stack
        assert runner.decode_stack is not None and runner.decode_stack.calls > 0
    else:
        assert runner.decode_stack is None


def test_prefix_cache_hit_and_ngram_speculation_keep_transformers_tokens(family):
    """A second run of a prompt reuses its cached blocks (with a window, those of its last window), and
    ngram speculation verifies drafts through each family's forward: both give transformers' 32
    greedy tokens."""
    case, hf, llm = family
    prompt = _prompt(6)[:10] * 3  # repeats: ngram finds drafts in it
    expected = hf_greedy(hf, prompt, 32)
    params = SamplingParams(temperature=0, max_tokens=32)
    llm.generate([prompt], params, use_tqdm=False)
    (again,) = llm.generate([prompt], params, use_tqdm=False)
    assert again.outputs[0].token_ids == expected
    assert again.num_cached_tokens > 0
    speculative = LLM(
        llm.engine.config.model.path,
        dtype="float32",
        max_model_len=128,
        kv_cache_memory="8MiB",
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    try:
        (output,) = speculative.generate([prompt], params, use_tqdm=False)
    finally:
        speculative.shutdown()
    assert output.outputs[0].token_ids == expected
