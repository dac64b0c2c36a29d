"""Multi-token steps end exactly where single-token decoding would (max_tokens, stop tokens, stop strings,
min_tokens, logprobs), blocks never leak through rejections, preemptions or aborts, and seeded sampling
with speculation is reproducible."""

from __future__ import annotations

import copy

import pytest

from llmserve import SamplingParams

from .conftest import PROMPTS, TARGET_LAYERS, assert_no_leaks, greedy, make_llm, spec_kwargs, token_ids

SELF_DRAFT = dict(speculative_method="early_exit", speculative_draft_layers=TARGET_LAYERS)


@pytest.fixture(scope="module")
def self_draft_llm(target_dir):
    """Accepts every draft: with K = 8 each step brings 9 tokens, so stops land mid-step."""
    return make_llm(target_dir, num_speculative_tokens=8, **SELF_DRAFT)


@pytest.fixture(scope="module")
def reference(reference_llm) -> list[list[int]]:
    return token_ids(reference_llm.generate(PROMPTS, greedy(), use_tqdm=False))


def _completion(output) -> tuple:
    c = output.outputs[0]
    return list(c.token_ids), c.text, c.finish_reason, c.stop_reason


def test_max_tokens_is_exact(self_draft_llm, reference):
    lengths = [1, 2, 5, 9, 10, 17]
    params = [greedy(n) for n in lengths]
    outputs = self_draft_llm.generate([PROMPTS[0]] * len(lengths), params, use_tqdm=False)
    assert token_ids(outputs) == [reference[0][:n] for n in lengths]
    assert {o.outputs[0].finish_reason for o in outputs} == {"length"}
    assert_no_leaks(self_draft_llm)


def test_stop_token_ids_and_min_tokens_match_single_token_decoding(self_draft_llm, reference_llm, reference):
    stop = reference[2][6]
    first = reference[2].index(stop)
    later = next(t for t in reference[2][first + 3 :] if t not in reference[2][: first + 3])
    cases = [
        greedy(stop_token_ids=[stop]),
        greedy(stop_token_ids=[stop], min_tokens=first + 2),  # suppressed until min_tokens
        greedy(stop_token_ids=[later, stop], min_tokens=first + 2),
    ]
    prompts = [PROMPTS[2]] * len(cases)
    got = self_draft_llm.generate(prompts, cases, use_tqdm=False)
    expected = reference_llm.generate(prompts, cases, use_tqdm=False)
    assert [_completion(o) for o in got] == [_completion(o) for o in expected]
    assert token_ids(got)[0] == reference[2][: first + 1]
    assert got[0].outputs[0].finish_reason == "stop" and got[0].outputs[0].stop_reason == stop
    assert len(token_ids(got)[1]) > first + 2
    assert_no_leaks(self_draft_llm)


def test_stop_strings_match_single_token_decoding(self_draft_llm, reference_llm):
    full = reference_llm.generate(PROMPTS[:3], greedy(), use_tqdm=False)
    cases = []
    for output in full:
        text = output.outputs[0].text
        middle = text[len(text) // 2 :].strip()
        cases.append(greedy(stop=[middle[:3]]))
    got = self_draft_llm.generate(PROMPTS[:3], cases, use_tqdm=False)
    expected = reference_llm.generate(PROMPTS[:3], cases, use_tqdm=False)
    assert [_completion(o) for o in got] == [_completion(o) for o in expected]
    for output, case in zip(got, cases, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop" and completion.stop_reason == case.stop[0]
        assert case.stop[0] not in completion.text
    assert_no_leaks(self_draft_llm)


def test_logprobs_of_multi_token_steps(self_draft_llm, reference_llm):
    params = greedy(logprobs=2)
    got = self_draft_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    expected = reference_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for a, b in zip(got, expected, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert [sorted(e) for e in ca.logprobs] == [sorted(e) for e in cb.logprobs]
        for ea, eb in zip(ca.logprobs, cb.logprobs, strict=True):
            assert all(abs(_value(ea[t]) - _value(eb[t])) < 1e-4 for t in ea)
        assert abs(ca.cumulative_logprob - cb.cumulative_logprob) < 1e-3
    assert got[0].spec_decode.num_accepted_tokens > 0


def _value(entry) -> float:
    return entry if isinstance(entry, float) else entry.logprob


# -- blocks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "early_exit", "draft", "draft_head_only", "suffix", "eagle"])
def test_no_leaks_through_rejections_preemption_and_aborts(
    target_dir, other_draft_dir, draft_head, reference, method
):
    """A pool too small for all requests with K = 8 drafts forces preemptions and dropped drafts; the
    draft model rejects nearly everything. Integrity holds after every step; aborted requests free
    their blocks at once; the survivors' tokens are unchanged; everything returns to the pool."""
    kwargs = spec_kwargs(method, target_dir, other_draft_dir, draft_head)
    kwargs.update(block_size=16, num_kv_blocks=10, preemption_mode="recompute")
    if method == "ngram":  # 1-token matches: more drafts, and more of them wrong
        kwargs.update(prompt_lookup_min=1)
    llm = make_llm(target_dir, num_speculative_tokens=8, **kwargs)
    engine = llm.engine
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), prompt, greedy())
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.kv_cache_manager.check_integrity()
        steps += 1
        if steps == 3:
            for request_id in ("1", "4"):
                engine.abort_request(request_id)
            engine.kv_cache_manager.check_integrity()
            assert not engine.kv_cache_manager.get_block_table("1")
    survivors = [i for i in range(len(PROMPTS)) if i not in (1, 4)]
    got = [list(finished[str(i)].outputs[0].token_ids) for i in survivors]
    assert got == [reference[i] for i in survivors]
    assert engine.scheduler.num_preemptions > 0
    assert engine.spec_decode_stats.num_draft_tokens > engine.spec_decode_stats.num_accepted_tokens
    assert_no_leaks(llm)


# -- sampling -------------------------------------------------------------------------------------


def _sampled(seed: int | None, k: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=0.8, top_k=3, max_tokens=12, ignore_eos=True, seed=seed, num_speculative_tokens=k
    )


@pytest.mark.parametrize("method", ["ngram", "early_exit", "draft", "draft_head", "suffix", "eagle"])
def test_seeded_sampling_is_reproducible_alone_or_batched(target_dir, other_draft_dir, draft_head, method):
    kwargs = spec_kwargs(method, target_dir, other_draft_dir, draft_head)
    llm = make_llm(target_dir, num_speculative_tokens=4, **kwargs)
    params = [_sampled(seed=i) for i in range(len(PROMPTS))]
    first = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    again = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    alone = token_ids(llm.generate([PROMPTS[0]], params[0], use_tqdm=False))
    assert first == again
    assert alone[0] == first[0]
    assert all(len(ids) == 12 and all(0 <= t < 49152 for t in ids) for ids in first)
    assert len({tuple(ids) for ids in first}) == len(first)
    unseeded = llm.generate(PROMPTS, _sampled(seed=None), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in unseeded)
    # Speculation ran while sampling. Whether prompt lookup finds a match in 12 sampled tokens is
    # chance (and unseeded tokens depend on how steps were batched), so the check takes a seeded batch
    # that follows the target's argmax (top_k 1), which on PROMPTS repeats an earlier bigram.
    argmax = SamplingParams(temperature=0.8, top_k=1, max_tokens=32, ignore_eos=True, seed=7)
    llm.generate(PROMPTS, argmax, use_tqdm=False)
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0
    assert_no_leaks(llm)


def test_sampled_self_draft_accepts_nearly_everything(self_draft_llm):
    """p == q (up to float32 rounding across batch shapes): min(1, p/q) accepts every draft."""
    before = copy.copy(self_draft_llm.engine.spec_decode_stats)
    prompts = PROMPTS * 2  # enough drafts to judge the rate (each request drafts from its first decode on)
    self_draft_llm.generate(prompts, [_sampled(seed=i) for i in range(len(prompts))], use_tqdm=False)
    after = self_draft_llm.engine.spec_decode_stats
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert drafted > 50
    assert accepted / drafted >= 0.98


def test_sliding_window_early_exit_matches_and_draft_model_is_refused(target_dir, other_draft_dir):
    """Early exit shares the target's windowed KV; a draft model would have to catch up over blocks
    the window already freed, so the engine refuses that combination with a clear error."""
    prompts = [p * 4 for p in PROMPTS[:3]]
    window = dict(sliding_window=32, attention_sinks=4)
    expected = token_ids(make_llm(target_dir, **window).generate(prompts, greedy(40), use_tqdm=False))
    llm = make_llm(target_dir, **window, **spec_kwargs("early_exit", target_dir, other_draft_dir))
    assert token_ids(llm.generate(prompts, greedy(40), use_tqdm=False)) == expected
    assert llm.engine.spec_decode_stats.num_accepted_tokens > 0
    assert_no_leaks(llm)
    with pytest.raises(ValueError, match="sliding-window"):
        make_llm(target_dir, **window, **spec_kwargs("draft", target_dir, other_draft_dir))
