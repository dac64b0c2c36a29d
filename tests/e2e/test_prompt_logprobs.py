"""Prompt logprobs from the engine equal transformers' float32 log-softmax at every prompt position,
whether the prompt runs in one step or in chunks, with n > 1, and on a prompt the prefix cache holds."""

from __future__ import annotations

import pytest
import torch
import transformers

from llmserve.config import EngineArgs
from llmserve.engine.llm_engine import LLMEngine
from llmserve.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers import make_tiny_llama_dir

PROMPT = list(range(100, 141))  # 41 tokens: 40 rows
TOP_N = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny") / "m"))


@pytest.fixture(scope="module")
def reference(model_dir) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)[:-1]  # row p: token p + 1


def run(model_dir: str, params: SamplingParams, repeats: int = 1, **engine) -> list:
    args = EngineArgs(model=model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB", **engine)
    llm = LLMEngine(args)
    finals = []
    for index in range(repeats):  # one after the other: the second finds the prompt in the prefix cache
        llm.add_request(f"r{index}", PROMPT, params.with_output_kind(RequestOutputKind.FINAL_ONLY))
        while llm.has_unfinished_requests():
            finals += llm.step()
    return finals


def assert_matches_reference(logprobs, reference: torch.Tensor) -> None:
    assert logprobs.first_position == 0 and len(logprobs.token_logprobs) == len(PROMPT) - 1
    targets = torch.tensor(PROMPT[1:])
    expected = reference.gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs), expected, atol=1e-4, rtol=0)
    expected_ranks = (reference > expected[:, None]).sum(-1) + 1
    assert logprobs.token_ranks == expected_ranks.tolist()
    top = reference.topk(TOP_N, dim=-1)
    assert logprobs.top_token_ids == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(logprobs.top_logprobs), top.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("budget", [2048, 16], ids=["one-step", "chunked"])
def test_prompt_logprobs_match_transformers(model_dir, reference, budget):
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP_N)
    (output,) = run(model_dir, params, max_num_batched_tokens=budget)
    assert_matches_reference(output.prompt_logprobs, reference)


def test_prompt_logprobs_with_n_and_a_cached_prompt(model_dir, reference):
    params = SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1, prompt_logprobs=TOP_N)
    outputs = run(model_dir, params, repeats=2)  # prefix caching is on by default
    assert len(outputs) == 2 and outputs[1].num_cached_tokens == 0  # the cache is not read for them
    for output in outputs:
        assert len(output.outputs) == 3
        assert_matches_reference(output.prompt_logprobs, reference)


def test_requests_without_prompt_logprobs_get_none(model_dir):
    (output,) = run(model_dir, SamplingParams(max_tokens=2, temperature=0.0))
    assert output.prompt_logprobs is None
