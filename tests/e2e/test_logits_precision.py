"""Logits in float32 on the default bfloat16 engine: rounding them to bf16 made near-tied tokens
exact ties (the first answer token to "What is the capital of France?": -1.883 and -1.965 in
float32, both -1.886 in bf16), and the tie went to the wrong token."""

import pytest
import torch

from llmserve import LLM, SamplingParams

from .conftest import teacher_forced_logits

pytestmark = [pytest.mark.slow, pytest.mark.full]

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.",
    "List three prime numbers.",
    "What does a CPU do?",
    "Suggest a name for a pet cat.",
    "Why is the sky blue?",
    "How many days are in a leap year?",
    "What is the largest planet in the solar system?",
    "Write a Python function that adds two numbers.",
    "What language is spoken in Brazil?",
    "Describe a rainbow in two sentences.",
    "What is the opposite of cold?",
    "Recommend a book for a long flight.",
]
MAX_NEW = 32
# float32's top-two gap above which bf16 must pick the same token. bf16's rounding of the weights and
# activations moves this model's logits (about 30 at the top) by up to ~0.1 on its own: on an AMX
# CPU (oneDNN's bf16 GEMMs there) one answer token at a 0.104 gap flipped, on AVX-512 CPUs none did.
CLEAR_GAP = 0.2


@pytest.fixture(scope="module")
def llm_bf16():
    return LLM(dtype="bfloat16", quantization="none", kv_cache_memory="256MiB", prefix_caching=False)


@pytest.fixture(scope="module")
def llm_fp32_uncached():
    return LLM(dtype="float32", quantization="none", kv_cache_memory="256MiB", prefix_caching=False)


def _chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_the_france_question_is_not_decided_by_a_rounded_tie(llm_bf16):
    """The regression itself: its first answer token's top two logits, 0.08 apart in float32 (under
    CLEAR_GAP: which one bf16 weights favour depends on the CPU's GEMM kernels), stay apart as float32
    logits instead of rounding to one bf16 value, and greedy takes the larger."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
    output = llm_bf16.chat(_chat(QUESTIONS[0]), params, use_tqdm=False)[0].outputs[0]
    logprobs = output.logprobs[0]
    (first, first_logprob), (_, second_logprob) = sorted(logprobs.items(), key=lambda item: -item[1])
    assert first_logprob > second_logprob
    assert output.token_ids[0] == first


def test_bfloat16_argmax_agrees_with_float32_wherever_float32_is_clear(llm_bf16, llm_fp32_uncached):
    """Teacher-forced on float32's own greedy answers to 20 chat prompts (32 tokens each)."""
    answers = llm_fp32_uncached.chat(
        [_chat(q) for q in QUESTIONS], SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False
    )
    checked = 0
    for question, answer in zip(QUESTIONS, answers, strict=True):
        prompt = list(answer.prompt_token_ids)
        ids = prompt + list(answer.outputs[0].token_ids)
        positions = slice(len(prompt) - 1, len(ids) - 1)  # each predicts the next answer token
        reference = teacher_forced_logits(llm_fp32_uncached, ids)[positions]
        ours = teacher_forced_logits(llm_bf16, ids)[positions]
        assert ours.dtype == torch.float32
        top2 = reference.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > CLEAR_GAP
        differs = reference.argmax(dim=-1) != ours.argmax(dim=-1)
        assert not (clear & differs).any(), (question, (clear & differs).nonzero().flatten().tolist())
        checked += int(clear.sum())
    print(f"{checked} clear positions")
    assert checked >= 400  # most positions are clear; the test is not vacuous
