"""N-gram prompt lookup (exact proposals, proposed after a step) and the scheduler-side draft planner
(taking proposals, reserving lookahead slots for model drafts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve.config import SchedulerConfig
from llmserve.config.speculative import SpeculativeConfig
from llmserve.core.draft_planner import DraftPlanner
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.scheduler import Scheduler
from llmserve.request import DraftProposal, Request
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.proposer import SampledBatch
from llmserve.spec_decode.proposers.ngram import NgramProposer, PromptLookup


def propose(tokens: list[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    return PromptLookup(min_n, max_n).drafts(np.array(tokens, dtype=np.int64), k).tolist()


def test_longest_match_wins_over_a_later_shorter_one():
    # Suffix [1, 2, 3] occurs at 0..2 (3 tokens) and [2, 3] at 6..7 (2 tokens, later).
    tokens = [1, 2, 3, 4, 9, 9, 2, 3, 6, 5, 1, 2, 3]
    assert propose(tokens, 3) == [4, 9, 9]


def test_latest_of_equally_long_matches_wins():
    # [2, 3] ends at 2 and at 7 with the same length (2): the later one's continuation.
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 2, 3]
    assert propose(tokens, 2) == [5, 8]


def test_continuation_is_cut_at_num_drafts():
    tokens = [7, 8, 1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(tokens, 1) == [3]
    assert propose(tokens, 4) == [3, 4, 5, 6]


def test_periodic_text_continues_past_the_end_lz77_style():
    assert propose([5, 1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert propose([3, 3, 3], 4) == [3, 3, 3, 3]
    assert propose([9, 4, 5, 6, 4, 5, 6], 6) == [4, 5, 6, 4, 5, 6]


def test_no_match_proposes_nothing():
    assert propose([1, 2, 3, 4, 5], 3) == []
    assert propose([1, 2, 3, 1, 5, 3], 3) == []  # only a 1-token match: below min_n = 2
    assert propose([1, 2, 3, 1, 5, 3], 3, min_n=1) == [1, 5]  # at most 2 ** 1 drafts
    assert propose([4], 3) == []
    assert propose([1, 2, 1, 2], 0) == []


def test_a_match_of_n_tokens_proposes_at_most_2_to_the_n():
    # Continuations of 8 tokens follow a 1-, a 2- and a 3-token match of the suffix.
    tail = [10, 11, 12, 13, 14, 15, 16, 17]
    assert propose([3, *tail, 9, 3], 8, min_n=1) == tail[:2]
    assert propose([2, 3, *tail, 9, 2, 3], 8, min_n=1) == tail[:4]
    assert propose([1, 2, 3, *tail, 9, 1, 2, 3], 8, min_n=1) == tail
    assert propose([1, 2, 3, *tail, 9, 1, 2, 3], 5, min_n=1) == tail[:5]


def test_max_n_bounds_the_suffix_tried():
    # With max_n = 2 the 3-token match at 0..2 is no longer preferred over the later 2-token one.
    tokens = [1, 2, 3, 4, 9, 9, 2, 3, 6, 5, 1, 2, 3]
    assert propose(tokens, 3, max_n=2) == [6, 5, 1]


# -- the planner --------------------------------------------------------------------------------------


def _config(method: str = "ngram", k: int = 3, disable: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig.create(method, k, 2, 4, None, None, disable)


def _request(tokens: list[int], **params) -> Request:
    return Request("r", tokens, SamplingParams(**params))


def _decoding(tokens: list[int], **params) -> Request:
    """A request past its first token: `tokens` end with its one output token."""
    request = _request(tokens[:-1], **params)
    request.append_output_token(tokens[-1])
    return request


def _proposed(tokens: list[int], drafts: list[int], **params) -> Request:
    request = _request(tokens, **params)
    request.draft_proposal = DraftProposal(request.num_tokens, drafts)
    return request


def test_ngram_proposes_after_the_step_from_the_tokens_including_the_new_ones():
    proposer = NgramProposer(_config(k=3))
    requests = [
        _decoding([5, 1, 2, 1, 2, 1]),
        _decoding([1, 2, 3]),  # no match
        _decoding([5, 1, 2, 1, 2, 1], num_speculative_tokens=0),  # does not speculate
        _decoding([5, 1, 2, 1, 2, 1], max_tokens=4),  # room for one draft before max_tokens
    ]
    for index, request in enumerate(requests):
        request.request_id = f"r{index}"
    proposals = proposer.propose(SampledBatch(requests, [[2], [4], [2], [2]], torch.zeros(4, 1)))
    assert proposals == {
        "r0": DraftProposal(7, [1, 2, 1]),
        "r1": None,
        "r2": None,
        "r3": DraftProposal(7, [1]),
    }
    auto = proposer.propose(
        SampledBatch(requests[:1], [[2]], torch.zeros(1, 1), max_drafts=2)
    )  # auto's share
    assert auto == {"r0": DraftProposal(7, [1, 2])}


def test_planner_takes_the_proposal_within_the_room_given():
    planner = DraftPlanner(_config(k=3))
    request = _proposed([5, 1, 2, 1, 2, 1, 2], [1, 2, 1, 2, 1])
    assert planner.plan(request, max_drafts=8) == 3
    assert request.spec_token_ids == [1, 2, 1]
    assert planner.plan(request, max_drafts=2) == 2
    assert request.spec_token_ids == [1, 2]
    assert planner.plan(_request([1, 2, 3]), max_drafts=8) == 0  # no proposal
    stale = _request([1, 2, 3])
    stale.draft_proposal = DraftProposal(2, [3, 4])  # made before the last token
    assert planner.plan(stale, max_drafts=8) == 0


def test_per_request_k_overrides_the_engine_and_zero_turns_it_off():
    planner = DraftPlanner(_config(k=3))
    assert planner.plan(_proposed([5, 1, 2, 1, 2, 1, 2], [1] * 7, num_speculative_tokens=5), 8) == 5
    off = _proposed([5, 1, 2, 1, 2, 1, 2], [1] * 7, num_speculative_tokens=0)
    assert planner.plan(off, 8) == 0
    assert off.spec_token_ids == []


def test_model_methods_reserve_lookahead_slots_for_the_next_drafts():
    planner = DraftPlanner(_config(method="early_exit", k=4))
    assert planner.num_lookahead_tokens(_request([1, 2, 3]), share=None) == 4
    assert planner.num_lookahead_tokens(_request([1, 2, 3]), share=2) == 2
    assert planner.num_lookahead_tokens(_request([1, 2, 3], num_speculative_tokens=1), share=None) == 1
    assert DraftPlanner(_config(k=4)).num_lookahead_tokens(_request([1, 2, 3]), share=None) == 0


def test_lookahead_is_allocated_past_the_step_and_never_preempts():
    """A decode verifying 2 drafts with K = 4 takes slots for its 3 tokens and 4 lookahead ones (the
    new token's and 3 drafts'): 10 + 3 + 4 positions = 5 blocks of 4. In a pool of 4 blocks the
    lookahead is dropped instead of preempting anything."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    for num_blocks, expected_blocks in ((8, 5), (4, 4)):
        kv = KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=False)
        scheduler = Scheduler(config, kv, draft_planner=DraftPlanner(_config("early_exit", k=4, disable=0)))
        request = _request(list(range(10, 20)), max_tokens=32)
        scheduler.add_request(request)
        scheduler.update_from_output(scheduler.schedule(), {"r": [7]})  # prefill: 10 tokens, 1 sampled
        request.draft_proposal = DraftProposal(request.num_tokens, [8, 9])
        output = scheduler.schedule()
        assert output.plan.num_scheduled_tokens == {"r": 3} and output.plan.spec_token_ids == {"r": [8, 9]}
        assert len(kv.get_block_table("r")) == expected_blocks
        assert scheduler.num_preemptions == 0


def test_auto_disable_above_the_batch_size():
    planner = DraftPlanner(_config(disable=4))
    assert [planner.is_enabled(n) for n in (1, 4, 5, 64)] == [True, True, False, False]
    assert DraftPlanner(_config(disable=0)).is_enabled(1000)


def test_auto_mode_shares_the_verify_rows_among_the_decodes():
    """Auto mode keeps a step's decodes within 8 rows (1 + k each), the small-batch kernels' limit,
    and drafts nothing where that leaves a single draft each; always-on speculation has no cap."""
    planner = DraftPlanner(_config(k=7, disable=4))
    assert [planner.drafts_per_request(n) for n in (1, 2, 3, 4, 5, 8)] == [7, 3, 0, 0, 0, 0]
    assert DraftPlanner(_config(k=7, disable=0)).drafts_per_request(2) is None


@pytest.mark.parametrize(
    "args, message",
    [
        (("hydra", 3, 2, 4, None, None, 0), "speculative_method"),
        (("medusa", 3, 2, 4, None, None, 0), "speculative-draft-head"),
        (("ngram", 0, 2, 4, None, None, 0), "num_speculative_tokens"),
        (("ngram", 3, 3, 2, None, None, 0), "prompt_lookup_min"),
        (("draft", 3, 2, 4, None, None, 0), "draft-model"),
        (("early_exit", 3, 2, 4, None, 0, 0), "speculative_draft_layers"),
        (("ngram", 3, 2, 4, None, None, -1), "speculative_disable_batch_size"),
    ],
)
def test_config_rejects_bad_flags_naming_them(args, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.create(*args)
    assert SpeculativeConfig.create("none", 3, 2, 4, None, None, 0) is None


def test_default_k_is_the_methods():
    """N-gram drafts adapt to the match, so K is only their cap (7: an 8-row verify pass)."""
    assert SpeculativeConfig.create("ngram", None, 2, 4, None, None, 0).num_speculative_tokens == 7
    assert SpeculativeConfig.create("early_exit", None, 2, 4, None, None, 0).num_speculative_tokens == 3
    assert SpeculativeConfig.create("ngram", 2, 2, 4, None, None, 0).num_speculative_tokens == 2
