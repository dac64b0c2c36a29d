"""Speculation costs no first-token time: a request's first token leaves with the step that finishes its
prompt, and no proposer works for it before then (no lookup, no head, no draft model catch-up)."""

from __future__ import annotations

import pytest
from torch.overrides import TorchFunctionMode

from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.proposers.ngram import PromptLookup
from tests.spec_decode.conftest import PROMPTS, greedy, make_llm, spec_kwargs, token_ids

REPEATING = [5, 6, 7, 8] * 6  # prompt lookup matches here; so does a draft head's lookup


class _CountTorchCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _record_proposals(engine, monkeypatch) -> list[tuple[dict, int]]:
    """Each propose call's proposals and the work it did (torch calls plus prompt lookups), appended
    as the engine steps."""
    calls: list[tuple[dict, int]] = []
    propose, drafts = engine.proposer.propose, PromptLookup.drafts
    lookups = [0]

    def counted_drafts(self, token_ids, num_drafts):
        lookups[0] += 1
        return drafts(self, token_ids, num_drafts)

    def recorded(batch):
        lookups[0] = 0
        with _CountTorchCalls() as counter:
            proposals = propose(batch)
        calls.append((proposals, counter.calls + lookups[0]))
        return proposals

    monkeypatch.setattr(PromptLookup, "drafts", counted_drafts)
    engine.proposer.propose = recorded
    return calls


def _first_tokens(outputs) -> set[str]:
    return {o.request_id for o in outputs if len(o.outputs[0].token_ids) > 0}


@pytest.mark.parametrize("method", ["ngram", "draft_head", "draft", "early_exit"])
def test_a_new_prompts_first_token_leaves_with_its_prefill_step_before_any_drafting(
    method, target_dir, other_draft_dir, draft_head, monkeypatch
):
    llm = make_llm(target_dir, **spec_kwargs(method, target_dir, other_draft_dir, draft_head))
    engine = llm.engine
    calls = _record_proposals(engine, monkeypatch)
    engine.add_request("alone", REPEATING, greedy(8))
    assert _first_tokens(engine.step()) == {"alone"}  # the prefill step sampled and returned it
    [(proposals, work)] = calls
    assert proposals == {"alone": None} and work == 0  # no lookup, no head, no draft forward
    engine.step()  # its first decode: nothing to verify yet; it drafts after this step
    assert engine.spec_decode_stats.num_drafts == 0
    assert calls[-1][1] > 0  # the proposer did work for it now

    # A prompt finishing beside a decode: the new request gets nothing until its first decode.
    engine.add_request("new", PROMPTS[4], greedy(8))
    assert "new" in _first_tokens(engine.step())
    assert calls[-1][0]["new"] is None
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("method", ["ngram", "draft_head", "draft_self"])
def test_greedy_outputs_are_the_target_s_with_drafting_from_the_first_decode(
    method, target_dir, other_draft_dir, draft_head, reference_llm
):
    expected = token_ids(reference_llm.generate(PROMPTS, greedy(), use_tqdm=False))
    llm = make_llm(target_dir, **spec_kwargs(method, target_dir, other_draft_dir, draft_head))
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == expected
    assert llm.engine.spec_decode_stats.num_accepted_tokens > 0
    one = llm.generate(
        [REPEATING], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False
    )
    assert token_ids(one) == token_ids(reference_llm.generate([REPEATING], greedy(2), use_tqdm=False))


def test_torch_call_counter_sees_a_proposer_s_work(target_dir, other_draft_dir, draft_head, monkeypatch):
    """The torch-call counter the test above relies on does count a model proposer's forward."""
    llm = make_llm(target_dir, **spec_kwargs("early_exit", target_dir, other_draft_dir, draft_head))
    calls = _record_proposals(llm.engine, monkeypatch)
    llm.generate([REPEATING], greedy(4), use_tqdm=False)
    assert max(count for _, count in calls) > 0
