"""Prompt logprobs (the LM head's gather joins every slice on every rank) and pooled embeddings under
tensor parallelism equal one process's."""

from __future__ import annotations

import pytest
import torch

from llmserve.sampling_params import RequestOutputKind, SamplingParams
from tests.distributed.conftest import engine

pytestmark = pytest.mark.process

PROMPT = list(range(1000, 1040))
PARAMS = SamplingParams(
    max_tokens=2, temperature=0.0, prompt_logprobs=2, output_kind=RequestOutputKind.FINAL_ONLY
)


def run(llm) -> dict:
    core = llm.engine
    core.add_request("g", PROMPT, PARAMS)
    core.add_pooling_request("e", PROMPT[::-1])
    finals = {}
    while core.has_unfinished_requests():
        finals.update({o.request_id: o for o in core.step() if o.finished})
    return finals


def test_prompt_logprobs_and_embeddings_match_one_process(tiny_llama_dir):
    with engine(tiny_llama_dir) as llm:
        one = run(llm)
    with engine(tiny_llama_dir, tensor_parallel_size=2) as llm:
        two = run(llm)
    expected, got = one["g"].prompt_logprobs, two["g"].prompt_logprobs
    assert len(got.token_logprobs) == len(PROMPT) - 1
    torch.testing.assert_close(
        torch.tensor(got.token_logprobs), torch.tensor(expected.token_logprobs), atol=1e-4, rtol=0
    )
    assert got.top_token_ids == expected.top_token_ids
    # a rank deep in the tail can move by a near-tie (sums in another order), never by much
    ranks, expected_ranks = torch.tensor(got.token_ranks), torch.tensor(expected.token_ranks)
    assert ((ranks - expected_ranks).abs() <= expected_ranks // 200).all()
    cosine = torch.nn.functional.cosine_similarity(
        torch.tensor(two["e"].embedding), torch.tensor(one["e"].embedding), dim=0
    )
    assert cosine >= 0.9999
