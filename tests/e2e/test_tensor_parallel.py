"""The default model (SmolLM2-135M: 9 query / 3 KV heads) split over 2 ranks (6 + 3 query, 2 + 1 KV
heads) and 3 ranks gives one process's greedy tokens, up to 1e-4 near-ties (float32)."""

import pytest

from llmserve import LLM, SamplingParams
from llmserve.quantization.kernels import QuantizedLinear
from tests.distributed.conftest import assert_same_greedy

pytestmark = [pytest.mark.slow, pytest.mark.process]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("tp", [2, 3])
def test_default_model_greedy_matches_one_process(tp, llm_fp32):
    reference = llm_fp32.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory="64MiB", tensor_parallel_size=tp)
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    for want, got in zip(reference, outputs, strict=True):
        assert_same_greedy(want, got)


def test_gguf_native_weights_split_like_one_process():
    """`--quantization gguf` (Q4_1 decoder layers, Q8_0 lm_head): every rank cuts the GGUF's own
    blocks (groups of 32 fall on the 2-rank cuts: 384 + 192 o_proj and 768 + 768 down_proj columns)."""
    kwargs = dict(dtype="float32", kv_cache_memory="64MiB", quantization="gguf")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outputs = {}
    for tp in (1, 2):  # float32 dequantizes every layer at every step: two prompts, eight tokens
        llm = LLM(tensor_parallel_size=tp, **kwargs)
        try:
            outputs[tp] = llm.generate(PROMPTS[:2], params, use_tqdm=False)
            modules = llm.engine.model_runner.model.modules()
            assert sum(isinstance(m, QuantizedLinear) for m in modules) == 30 * 4 + 1  # and the lm_head
        finally:
            llm.shutdown()
    for want, got in zip(outputs[1], outputs[2], strict=True):
        assert_same_greedy(want, got)
