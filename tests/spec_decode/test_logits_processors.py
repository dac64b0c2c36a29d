"""A logits processor (logit_bias) under speculative decoding: the verifier and every proposer apply it,
so greedy outputs equal the plain engine's with the same bias."""

from __future__ import annotations

import pytest

from .conftest import PROMPTS, assert_no_leaks, greedy, make_llm, spec_kwargs, token_ids


@pytest.fixture(scope="module")
def bias(reference_llm) -> dict[int, float]:
    """Bans each prompt's first unbiased token and favours one token: outputs change everywhere."""
    unbiased = token_ids(reference_llm.generate(PROMPTS, greedy(), use_tqdm=False))
    return {**{out[0]: -100.0 for out in unbiased}, 5: 3.0}


@pytest.fixture(scope="module")
def biased_reference(reference_llm, bias) -> list[list[int]]:
    unbiased = token_ids(reference_llm.generate(PROMPTS, greedy(), use_tqdm=False))
    biased = token_ids(reference_llm.generate(PROMPTS, greedy(logit_bias=bias), use_tqdm=False))
    assert all(b[0] != u[0] for b, u in zip(biased, unbiased, strict=True))  # the bias took effect
    return biased


@pytest.mark.parametrize("method", ["ngram", "draft", "draft_head"])
def test_biased_greedy_with_speculation_equals_without(
    method, biased_reference, bias, target_dir, other_draft_dir, draft_head
):
    llm = make_llm(
        target_dir, num_speculative_tokens=3, **spec_kwargs(method, target_dir, other_draft_dir, draft_head)
    )
    outputs = llm.generate(PROMPTS, greedy(logit_bias=bias), use_tqdm=False)
    assert token_ids(outputs) == biased_reference
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0
    assert_no_leaks(llm)
