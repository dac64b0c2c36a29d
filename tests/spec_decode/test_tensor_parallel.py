"""Speculative decoding under tensor parallelism: a draft model, a draft head and suffix decoding draft
on rank 0 (the head from rank 0's copy of the whole vocabulary), the sharded target verifies, and the greedy
tokens are one process's without speculation (up to a near-tie, tests/distributed/conftest.py)."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import assert_same_greedy

from .conftest import PROMPTS, greedy, make_llm, spec_kwargs

pytestmark = pytest.mark.process


@pytest.mark.parametrize("method", ["draft_head_only", "draft_self", "suffix"])
def test_drafts_from_rank_0_keep_the_sharded_targets_tokens(
    method, target_dir, other_draft_dir, draft_head, reference_llm
):
    params = greedy(logprobs=2)
    reference = reference_llm.generate(PROMPTS, params, use_tqdm=False)
    llm = make_llm(
        target_dir, tensor_parallel_size=2, **spec_kwargs(method, target_dir, other_draft_dir, draft_head)
    )
    try:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.engine.spec_decode_stats
        kv_heads = llm.engine.model_runner.kv_cache.shape[3]
    finally:
        llm.shutdown()
    assert kv_heads == 1  # rank 0's share of the target's 2 KV heads
    # drafts were verified (the tiny target's head is rarely right; the target drafting for itself is)
    assert stats.num_draft_tokens > 0 and (method == "draft_head_only" or stats.num_accepted_tokens > 0)
    for want, got in zip(reference, outputs, strict=True):
        assert_same_greedy(want, got)
