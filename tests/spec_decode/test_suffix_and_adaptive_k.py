"""Suffix decoding (exact proposals from a request's own text and from recent requests' outputs, the
global structure's bounds and eviction) and adaptive K (each request's drafts follow its acceptance)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve.config import EngineArgs, SchedulerConfig
from llmserve.config.speculative import SpeculativeConfig, SuffixDecodingConfig
from llmserve.core.draft_planner import DraftPlanner
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.scheduler import Scheduler
from llmserve.request import DraftAcceptance, DraftProposal, Request
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.proposer import SampledBatch
from llmserve.spec_decode.proposers.suffix import (
    SEPARATOR,
    RecentOutputs,
    SuffixProposer,
    SuffixSearch,
    children,
    most_frequent_path,
)

from .conftest import PROMPTS, assert_no_leaks, greedy, make_llm, spec_kwargs, token_ids


def _ids(tokens: list[int]) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def drafts(context: list[int], k: int, recent: list[int] = (), **options) -> list[int]:
    return SuffixSearch(SuffixDecodingConfig(**options)).drafts(_ids(context), _ids(recent), k)


# -- the search -----------------------------------------------------------------------------------


def test_proposes_the_repeated_span_from_its_own_text():
    assert drafts([1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3], 3) == [4, 5, 6]
    # A loop: the continuation of an earlier period runs on past the latest one.
    assert drafts([5, 6, 7, 8] * 6, 7) == [5, 6, 7, 8, 5, 6, 7]


def test_the_most_frequent_continuation_wins_and_recency_breaks_ties():
    # After [7, 1, 2]: 3 follows twice and 4 once (the latest).
    text = [7, 1, 2, 3, 0, 7, 1, 2, 3, 0, 7, 1, 2, 4, 0, 7, 1, 2]
    assert drafts(text, 1, max_spec_factor=4.0) == [3]
    assert drafts([1, 2, 3, 0, 1, 2, 4, 0, 1, 2], 1) == [4]  # one each: the latest


def test_no_match_proposes_nothing():
    assert drafts([1, 2, 3, 4, 5], 3) == []
    assert drafts([4], 3) == []
    assert drafts([1, 2, 1, 2], 0) == []


def test_options_cap_the_drafts():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3]
    assert drafts(text, 8) == [4, 5, 6]  # max_spec_factor 1: as many drafts as matched tokens
    assert drafts(text, 8, max_spec_factor=2.0) == [4, 5, 6, 7, 8, 9]
    assert drafts(text, 8, max_spec_factor=2.0, max_tree_depth=5) == [4, 5]  # match + drafts <= depth
    assert drafts(text, 2, max_spec_factor=2.0) == [4, 5]  # K


def test_children_give_every_continuation_with_its_count_for_a_tree():
    """What a token tree would expand: all next tokens, the most frequent first, ties the latest first."""
    tokens, counts = children(_ids([7, 8, 7, 9, 8, 7]))
    assert tokens.tolist() == [7, 8, 9] and counts.tolist() == [3, 2, 1]
    tokens, counts = children(_ids([4, 5]))
    assert tokens.tolist() == [5, 4] and counts.tolist() == [1, 1]


def test_the_path_stops_where_its_probability_falls_below_the_minimum():
    # Five occurrences, then 10 (3 of 5), then 20 or 30 (2 of 3 after 10): 0.6, then 0.4.
    rows = _ids([[10, 20], [10, 20], [10, 30], [11, 40], [12, 50]])
    path = most_frequent_path(rows, min_prob=0.1)
    assert path.token_ids == [10, 20] and path.probs == pytest.approx([0.6, 0.4])
    assert most_frequent_path(rows, min_prob=0.5).token_ids == [10]
    assert most_frequent_path(rows, min_prob=0.7).token_ids == []
    # Occurrences whose continuation ran out leave the counts: 3 of the 3 that continue.
    ended = _ids([[10, 20], [10, 20], [10, 20], [10, SEPARATOR]])
    assert most_frequent_path(ended, min_prob=0.9).probs == [1.0, 1.0]


def test_proposes_from_recent_outputs_and_no_match_crosses_a_separator():
    recent = [50, 51, 52, 53, 54, SEPARATOR, 60, 61]
    assert drafts([9, 8, 50, 51, 52], 3, recent) == [53, 54]  # the output ends at its separator
    assert drafts([9, 54, 60], 3, recent, max_spec_factor=3.0) == [61]
    # [54, 60] spans two outputs: only the 1-token match [60] counts, for one draft.
    assert drafts([9, 54, 60], 3, recent) == [61]


def test_the_better_scoring_source_wins():
    """Own text: [1, 2] went on with 3 and with 4 (probability 0.5 each); recent outputs: with 7 8
    three times (1.0). A tie goes to the request's own text."""
    own = [1, 2, 3, 8, 1, 2, 4, 9, 1, 2]
    recent = [1, 2, 7, 8, SEPARATOR] * 3
    assert drafts(own, 2, recent) == [7, 8]
    assert drafts(own, 2) == [4, 9]
    assert drafts([1, 2, 5, 6, 0, 1, 2], 2, recent) == [5, 6]


# -- the global structure -------------------------------------------------------------------------


def test_recent_outputs_keep_the_last_requests_and_evict_the_oldest():
    recent = RecentOutputs(max_requests=2)
    recent.add(_ids([1, 2, 3]))
    recent.add(_ids([4, 5]))
    recent.add(_ids([]))  # nothing to keep
    assert recent.tokens().tolist() == [1, 2, 3, SEPARATOR, 4, 5, SEPARATOR] and len(recent) == 2
    recent.add(_ids([6, 7, 8]))
    assert recent.tokens().tolist() == [4, 5, SEPARATOR, 6, 7, 8, SEPARATOR] and len(recent) == 2
    assert drafts([9, 1, 2], 2, recent.tokens().tolist()) == []  # the evicted output is gone
    assert RecentOutputs(max_requests=0).tokens().tolist() == []


def test_recent_outputs_memory_stays_bounded():
    """Many outputs through a structure of 4: the tokens kept and the buffer holding them stay within
    a constant of 4 outputs (evicted tokens are compacted away, each copied at most once more)."""
    recent = RecentOutputs(max_requests=4)
    rng = np.random.default_rng(0)
    for _ in range(500):
        recent.add(rng.integers(0, 1000, size=int(rng.integers(1, 50)), dtype=np.int32))
        assert recent.num_tokens <= 4 * 50
        assert recent.capacity <= 4 * 4 * 50
    assert len(recent) == 4


def test_the_position_index_finds_what_a_scan_finds_and_drafts_are_unchanged():
    """Outputs added through eviction and compactions: each token's occurrences from the index equal
    a scan of the kept tokens, the index holds at most the buffer's positions, and drafts searched
    through the index equal drafts from a scan (the search before the index)."""
    rng = np.random.default_rng(3)
    recent = RecentOutputs(max_requests=5)
    search = SuffixSearch(SuffixDecodingConfig(max_spec_factor=2.0))
    proposed = 0
    for _ in range(300):
        recent.add(rng.integers(0, 12, size=int(rng.integers(0, 30)), dtype=np.int32))
        tokens = recent.tokens()
        for token in range(13):
            assert recent.occurrences(token).tolist() == np.flatnonzero(tokens == token).tolist()
        assert sum(len(p) for p in recent._positions.values()) <= 2 * recent.num_tokens
        context = rng.integers(0, 12, size=int(rng.integers(2, 20)), dtype=np.int32)
        expected = search.drafts(context, tokens, 6)
        assert search.drafts(context, tokens, 6, recent.occurrences(int(context[-1]))) == expected
        proposed += bool(expected)
    assert proposed > 100


def test_proposals_through_the_index_equal_proposals_from_a_scan():
    """Two proposers fed the same requests, one finding occurrences in the recent outputs by a scan."""
    rng = np.random.default_rng(4)
    live_a, live_b = {}, {}
    indexed, scanning = SuffixProposer(_suffix_config(), live_a), SuffixProposer(_suffix_config(), live_b)
    scanning.recent.occurrences = lambda token: np.flatnonzero(scanning.recent.tokens() == token)
    proposed = 0
    for step in range(60):
        prompt = rng.integers(0, 10, size=6).tolist()
        output = rng.integers(0, 10, size=int(rng.integers(1, 12))).tolist()
        new = [[int(rng.integers(0, 10))]]
        live_a[str(step)] = _state(str(step), prompt, output)
        live_b[str(step)] = _state(str(step), prompt, output)
        batch_a = SampledBatch([live_a[str(step)]], new, torch.zeros(1, 1))
        batch_b = SampledBatch([live_b[str(step)]], new, torch.zeros(1, 1))
        proposals = indexed.propose(batch_a)
        assert proposals == scanning.propose(batch_b)
        proposed += proposals[str(step)] is not None
        del live_a[str(step)], live_b[str(step)]  # finished: its output joins the recent outputs
    assert proposed > 20 and len(indexed.recent) == 8


def _state(request_id: str, prompt: list[int], output: list[int], **params):
    from llmserve.worker.request_state import CachedRequestState

    params = SamplingParams(max_tokens=64, **params)
    return CachedRequestState(request_id, prompt, prompt + output, params, (), None, [], 0)


def _suffix_config(k: int = 4, max_cached_requests: int = 8) -> SpeculativeConfig:
    suffix = SuffixDecodingConfig(max_spec_factor=4.0, max_cached_requests=max_cached_requests)
    return SpeculativeConfig.create("suffix", k, 2, 4, None, None, 0, suffix=suffix)


def test_a_finished_requests_output_serves_the_next_request():
    live = {}
    proposer = SuffixProposer(_suffix_config(), live)
    first = live["a"] = _state("a", [1, 2], [30, 31, 32, 33, 34, 35])
    batch = SampledBatch([first], [[36]], torch.zeros(1, 1))
    assert proposer.propose(batch) == {"a": None}  # nothing repeats in its own text
    del live["a"]  # finished: its output (36 included) joins the global structure at the next call
    second = live["b"] = _state("b", [7, 8, 9, 31, 32], [33])
    proposals = proposer.propose(SampledBatch([second], [[34]], torch.zeros(1, 1)))
    assert proposals == {"b": DraftProposal(7, [35, 36])}
    assert proposer.recent.tokens().tolist() == [30, 31, 32, 33, 34, 35, 36, SEPARATOR]


def test_no_work_for_a_request_before_its_first_token_leaves():
    """The step that finished a prompt returns its first token right after the proposer: the prompt
    is copied into its history only at its first decode."""
    live = {}
    proposer = SuffixProposer(_suffix_config(), live)
    request = live["r"] = _state("r", [5, 6, 5, 6, 5], [])
    assert proposer.propose(SampledBatch([request], [[6]], torch.zeros(1, 1))) == {"r": None}
    assert proposer.history("r") is None
    request.all_token_ids += [6]
    proposals = proposer.propose(SampledBatch([request], [[5]], torch.zeros(1, 1)))
    assert proposals == {"r": DraftProposal(7, [6, 5, 6, 5])}


def test_a_seeded_sampling_request_drafts_from_its_own_text_only():
    """Its draws depend on its drafts: its seed must give the same tokens whatever ran before."""
    live = {}
    proposer = SuffixProposer(_suffix_config(), live)
    proposer.recent.add(_ids([30, 31, 32, 33, 34]))
    seeded = live["s"] = _state("s", [7, 30, 31], [32], temperature=0.8, seed=1)
    unseeded = live["u"] = _state("u", [7, 30, 31], [32], temperature=0.8)
    greedy_seeded = live["g"] = _state("g", [7, 30, 31], [32], temperature=0.0, seed=1)
    batch = SampledBatch([seeded, unseeded, greedy_seeded], [[33]] * 3, torch.zeros(3, 1))
    assert proposer.propose(batch) == {"s": None, "u": DraftProposal(5, [34]), "g": DraftProposal(5, [34])}


def test_a_requests_own_text_grows_by_its_new_tokens():
    live = {}
    proposer = SuffixProposer(_suffix_config(max_cached_requests=0), live)
    request = live["r"] = _state("r", [1, 2, 3, 4, 5, 6, 7], [9])
    assert proposer.propose(SampledBatch([request], [[8]], torch.zeros(1, 1))) == {"r": None}
    request.all_token_ids += [8]  # the step's token appended, as apply_plan does
    proposals = proposer.propose(SampledBatch([request], [[1, 2]], torch.zeros(1, 1)))  # 1 draft accepted
    assert proposals == {"r": DraftProposal(11, [3, 4, 5, 6])}
    assert proposer.history("r").tolist() == [1, 2, 3, 4, 5, 6, 7, 9, 8, 1, 2]
    del live["r"]
    proposer.propose(SampledBatch([], [], torch.zeros(0, 1)))
    assert proposer.history("r") is None and len(proposer.recent) == 0  # max_cached_requests 0: kept nowhere


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(max_tree_depth=1), "suffix_decoding_max_tree_depth"),
        (dict(max_cached_requests=-1), "suffix_decoding_max_cached_requests"),
        (dict(max_spec_factor=0.0), "suffix_decoding_max_spec_factor"),
        (dict(min_token_prob=1.5), "suffix_decoding_min_token_prob"),
    ],
)
def test_suffix_options_are_validated_naming_the_flag(options, message):
    with pytest.raises(ValueError, match=message):
        SuffixDecodingConfig(**options)


def test_suffix_flags_reach_the_config():
    args = EngineArgs(speculative_method="suffix", suffix_decoding_max_tree_depth=12)
    suffix = args._suffix_decoding()
    assert suffix == SuffixDecodingConfig(max_tree_depth=12)
    assert EngineArgs(speculative_method="ngram")._suffix_decoding() is None
    config = SpeculativeConfig.create("suffix", None, 2, 4, None, None, 0, suffix=suffix)
    assert config.num_speculative_tokens == 7 and config.suffix.max_tree_depth == 12
    assert SpeculativeConfig.create("ngram", None, 2, 4, None, None, 0, suffix=suffix).suffix is None


# -- adaptive K -----------------------------------------------------------------------------------


def test_adaptive_k_shrinks_on_rejection_grows_on_acceptance_and_never_exceeds_k():
    acceptance = DraftAcceptance()
    assert acceptance.limit(7) == 7  # no verify pass yet: the full K
    limits = []
    for _ in range(5):
        acceptance.observe(num_drafts=acceptance.limit(7), num_accepted=0)
        limits.append(acceptance.limit(7))
    assert limits == sorted(limits, reverse=True) and limits[-1] == 1  # down to one draft, not zero
    for _ in range(12):
        k = acceptance.limit(7)
        acceptance.observe(num_drafts=k, num_accepted=k)
        limits.append(acceptance.limit(7))
    assert limits[5:] == sorted(limits[5:]) and limits[-1] == 7 and max(limits) == 7
    assert acceptance.limit(3) == 3 and acceptance.limit(0) == 0  # a request's own K caps it
    partly = DraftAcceptance()
    for _ in range(8):
        partly.observe(num_drafts=6, num_accepted=2)
    assert partly.limit(7) == 3  # one more than it accepts


def _planner(adaptive_k: bool = True, k: int = 7, method: str = "ngram") -> DraftPlanner:
    return DraftPlanner(SpeculativeConfig.create(method, k, 2, 4, None, None, 0, adaptive_k=adaptive_k))


def _rejecting_request(**params) -> Request:
    request = Request("r", [5, 1, 2, 1, 2, 1, 2], SamplingParams(**params))
    request.draft_acceptance.observe(num_drafts=7, num_accepted=1)  # one more than that: 2
    request.draft_proposal = DraftProposal(request.num_tokens, [1] * 7)
    return request


def test_planner_takes_fewer_drafts_for_a_request_that_rejects_them():
    request = _rejecting_request()
    assert _planner().plan(request, max_drafts=8) == 2
    assert _planner().draft_limits([request]) == {"r": 2}
    assert _planner(method="early_exit").num_lookahead_tokens(request, share=None) == 2
    assert _planner(adaptive_k=False).plan(request, max_drafts=8) == 7
    assert _planner(adaptive_k=False).draft_limits([request]) == {}
    assert _planner().draft_limits([Request("s", [1, 2], SamplingParams())]) == {}  # at its K: not listed
    assert _planner().plan(_rejecting_request(num_speculative_tokens=0), max_drafts=8) == 0


def test_proposers_see_the_limit_through_the_sampled_batch():
    request = _state("r", [1, 2], [3])
    batch = SampledBatch([request], [[4]], torch.zeros(1, 1), draft_limits={"r": 2})
    assert batch.draft_limit(0, 7) == 2
    assert SampledBatch([request], [[4]], torch.zeros(1, 1)).draft_limit(0, 7) == 7


def test_scheduler_measures_acceptance_and_plans_the_limit():
    """A decode verifying 7 drafts of which none is accepted: its next plan lists a smaller limit for
    the proposer, and the planner takes no more drafts than that."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    kv = KVCacheManager(32, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(config, kv, draft_planner=_planner())
    request = Request("r", list(range(10, 20)), SamplingParams(max_tokens=32))
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), {"r": [7]})  # the prompt, one token sampled
    request.draft_proposal = DraftProposal(request.num_tokens, [1] * 7)
    output = scheduler.schedule()
    assert output.plan.spec_token_ids == {"r": [1] * 7} and output.plan.draft_limits == {}
    scheduler.update_from_output(output, {"r": [8]})  # every draft rejected
    request.draft_proposal = DraftProposal(request.num_tokens, [1] * 7)
    output = scheduler.schedule()
    limit = request.draft_acceptance.limit(7)
    assert 1 <= limit < 7
    assert output.plan.draft_limits == {"r": limit} and len(output.plan.spec_token_ids["r"]) == limit


# -- end to end -----------------------------------------------------------------------------------


def test_suffix_with_chunked_prefill_and_prefix_caching_equals_no_speculation(target_dir, reference_llm):
    """Prompts in chunks of 8 tokens, the second round from the prefix cache and with the first
    round's outputs in the global structure: the same tokens as plain decoding."""
    reference = token_ids(reference_llm.generate(PROMPTS, greedy(), use_tqdm=False))
    llm = make_llm(
        target_dir, speculative_method="suffix", max_num_batched_tokens=8, max_num_seqs=4, block_size=4
    )
    assert llm.engine.config.scheduler.enable_chunked_prefill
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    first = llm.engine.spec_decode_stats.num_accepted_tokens
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    assert llm.engine.kv_cache_manager.prefix_cache_hits > 0
    assert len(llm.engine.proposer.recent) > 0
    assert llm.engine.spec_decode_stats.num_accepted_tokens > first > 0
    assert_no_leaks(llm)


def test_adaptive_k_proposes_fewer_drafts_where_they_are_rejected(target_dir, other_draft_dir, reference_llm):
    """A draft model that is rarely right (another random model): with adaptive K the verify passes
    carry fewer drafts than K on average, and the tokens are plain decoding's either way."""
    reference = token_ids(reference_llm.generate(PROMPTS[:2], greedy(), use_tqdm=False))
    per_pass = []
    for adaptive in (True, False):
        kwargs = spec_kwargs("draft", target_dir, other_draft_dir)
        llm = make_llm(target_dir, num_speculative_tokens=5, speculative_adaptive_k=adaptive, **kwargs)
        assert token_ids(llm.generate(PROMPTS[:2], greedy(), use_tqdm=False)) == reference
        stats = llm.engine.spec_decode_stats
        assert stats.acceptance_rate < 0.5
        per_pass.append(stats.num_draft_tokens / stats.num_drafts)
        assert_no_leaks(llm)
    assert per_pass[0] < 3 < per_pass[1]
