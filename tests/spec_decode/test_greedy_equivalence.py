"""Greedy output with speculation is token for token the output without it (float32, tiny random Llama).

Every method, K in {1, 3, 5, 8} (engine-wide and per request), batch 1 and a batch mixed with requests
that do not speculate; the target as its own draft must accept everything.
"""

from __future__ import annotations

import pytest

from llmserve.spec_decode.proposer import Proposer

from .conftest import (
    MAX_TOKENS,
    PROMPTS,
    TARGET_LAYERS,
    assert_no_leaks,
    greedy,
    make_llm,
    spec_kwargs,
    token_ids,
)

PER_REQUEST_K = [None, 1, 5, 8, 0]  # None: the engine's K (3); 0: this request does not speculate


@pytest.fixture(scope="module")
def reference(reference_llm) -> list[list[int]]:
    return token_ids(reference_llm.generate(PROMPTS, greedy(), use_tqdm=False))


@pytest.fixture(
    scope="module",
    params=[
        "ngram",
        "early_exit",
        "early_exit_all",
        "draft",
        "draft_self",
        "draft_head",
        "draft_head_only",
        "suffix",
    ],
)
def method(request, target_dir, other_draft_dir, draft_head):
    kwargs = spec_kwargs(request.param, target_dir, other_draft_dir, draft_head)
    return request.param, make_llm(target_dir, num_speculative_tokens=3, **kwargs)


def test_mixed_batch_with_per_request_k_equals_no_speculation(method, reference):
    name, llm = method
    assert isinstance(llm.engine.proposer, Proposer)  # every method drafts through the one interface
    prompts = [p for p in PROMPTS for _ in PER_REQUEST_K]
    params = [greedy(k=k) for _ in PROMPTS for k in PER_REQUEST_K]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outputs) == [r for r in reference for _ in PER_REQUEST_K]
    for output, param in zip(outputs, params, strict=True):
        if param.num_speculative_tokens == 0:
            assert output.spec_decode is None
    stats = llm.engine.spec_decode_stats
    assert stats.num_draft_tokens > 0
    if name in ("early_exit_all", "draft_self"):
        assert stats.acceptance_rate >= 0.98
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # float32: exactly the same argmax
    elif name in ("ngram", "early_exit", "draft_head", "suffix"):
        assert stats.num_accepted_tokens > 0
    # draft_head_only is not held to acceptance here: a head trained on a random model's text does not
    # generalize to unseen prompts (held-out acceptance 0), so any hit would be luck. Acceptance of a
    # real head is tested on the default model (tests/e2e/test_invariance.py).
    assert_no_leaks(llm)


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_batch_of_one_equals_no_speculation(method, reference, k):
    _, llm = method
    output = llm.generate([PROMPTS[0]], greedy(k=k), use_tqdm=False)
    assert token_ids(output) == [reference[0]]
    assert_no_leaks(llm)


@pytest.mark.parametrize("k", [1, 5, 8])
def test_engine_wide_k(target_dir, reference, k):
    llm = make_llm(target_dir, speculative_method="ngram", num_speculative_tokens=k)
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    stats = llm.engine.spec_decode_stats
    assert stats.num_accepted_tokens > 0
    assert stats.num_draft_tokens <= k * stats.num_drafts


def test_drafts_adapted_to_the_match_length_equal_no_speculation(target_dir, reference):
    """With 1-token matches allowed, a match of n tokens proposes at most 2 ** n drafts: steps verify
    2, 4 or K drafts, in one batch, and the tokens stay those of plain decoding."""
    llm = make_llm(
        target_dir,
        speculative_method="ngram",
        num_speculative_tokens=7,
        prompt_lookup_min=1,
        prompt_lookup_max=7,
    )
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    stats = llm.engine.spec_decode_stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens < 7 * stats.num_drafts
    assert_no_leaks(llm)


def test_auto_disable_above_the_batch_size(target_dir, reference):
    """With disable_batch_size 2, six equally long requests never speculate; when four of them finish
    early, the last two do. The tokens are the same either way."""
    kwargs = dict(speculative_method="early_exit", speculative_draft_layers=TARGET_LAYERS)
    llm = make_llm(target_dir, speculative_disable_batch_size=2, **kwargs)
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    assert llm.engine.spec_decode_stats.num_drafts == 0
    lengths = [4, 4, 4, 4, 16, 24]
    outputs = llm.generate(PROMPTS, [greedy(n) for n in lengths], use_tqdm=False)
    assert token_ids(outputs) == [r[:n] for r, n in zip(reference, lengths, strict=True)]
    assert [o.spec_decode is not None for o in outputs] == [False] * 4 + [True] * 2
    assert_no_leaks(llm)


def test_auto_mode_keeps_a_steps_verify_rows_within_the_kernels_limit(target_dir, reference):
    """Auto mode: two running requests verify at most 3 drafts each (8 rows in all) although K is 7;
    alone, the last one may verify up to 7. The tokens are the same. (The target drafts for itself, so
    every draft is accepted and adaptive K keeps K.)"""
    llm = make_llm(target_dir, speculative_method="early_exit", num_speculative_tokens=7,
                   speculative_draft_layers=TARGET_LAYERS, speculative_disable_batch_size=4)  # fmt: skip
    counts: list[tuple[int, int]] = []  # (requests running, largest number of drafts) per step
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def recording_schedule():
        output = schedule()
        counts.append((len(scheduler.running), max(map(len, output.plan.spec_token_ids.values()), default=0)))
        return output

    scheduler.schedule = recording_schedule
    outputs = llm.generate(PROMPTS[:2], [greedy(8), greedy(MAX_TOKENS)], use_tqdm=False)
    assert token_ids(outputs) == [reference[0][:8], reference[1]]
    assert max(k for running, k in counts if running == 2) == 3
    assert max(k for running, k in counts if running == 1) > 3
    assert_no_leaks(llm)
