"""Speculative decoding under pipeline parallelism: rank 0 drafts when a batch comes back from the
last stage (a draft model in rank 0's process; a draft head on the hidden states the last stage
sends with the logits), the stages verify, and the greedy tokens are one process's without
speculation (up to a near-tie, tests/distributed/conftest.py)."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import assert_same_greedy

from .conftest import PROMPTS, greedy, make_llm, spec_kwargs

pytestmark = pytest.mark.process


def _run(target_dir: str, params, **kwargs):
    """Outputs, speculation's totals, the pipeline's overlap record and every draft proposed, by
    (request id, the tokens it follows)."""
    llm = make_llm(target_dir, **kwargs)
    drafts: dict[tuple[str, int], list[int]] = {}
    propose = llm.engine.proposer.propose

    def recorded(batch):
        proposals = propose(batch)
        for request_id, proposal in proposals.items():
            if proposal is not None:
                drafts[request_id, proposal.num_tokens] = proposal.token_ids
        return proposals

    llm.engine.proposer.propose = recorded
    try:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        record = None if llm.engine.batch_queue is None else llm.engine.batch_queue.record
        return outputs, llm.engine.spec_decode_stats, record, drafts
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["draft_self", "draft_head_only", "draft_head"])
def test_drafts_from_rank_0_keep_the_pipelined_targets_tokens(
    method, target_dir, other_draft_dir, draft_head, reference_llm
):
    """The greedy tokens of one process without speculation, and the drafts of one process with it:
    a draft head's come from the hidden states the last stage sent, so wrong ones would differ."""
    params = greedy(logprobs=2)
    reference = reference_llm.generate(PROMPTS, params, use_tqdm=False)
    spec = spec_kwargs(method, target_dir, other_draft_dir, draft_head)
    _, _, _, one_process_drafts = _run(target_dir, params, **spec)
    outputs, stats, record, drafts = _run(target_dir, params, pipeline_parallel_size=2, **spec)
    assert record.max_in_flight == 2
    assert stats.num_draft_tokens > 0 and (method == "draft_head_only" or stats.num_accepted_tokens > 0)
    for want, got in zip(reference, outputs, strict=True):
        assert_same_greedy(want, got)
    shared = drafts.keys() & one_process_drafts.keys()
    assert len(shared) >= 20
    assert {key: drafts[key] for key in shared} == {key: one_process_drafts[key] for key in shared}
