"""The logits-processor hook: logit_bias through the sampler, its greedy fast path and its log-probs."""

from __future__ import annotations

import pytest
import torch

from llmserve.sample.logits_processors import LogitsProcessing
from llmserve.sample.sampler import Sampler, leaves_logits_unchanged

from .test_sampler import build

sampler = Sampler()


def params(**kwargs):
    from llmserve.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, **kwargs)


def test_a_bias_steers_greedy_rows_and_leaves_the_others_alone():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [0.0, 1.0, 5.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    batch = [params(logit_bias={2: -100}), params(), params(logit_bias={1: 100})]
    metadata = build(batch, vocab=4)
    assert not leaves_logits_unchanged(metadata)  # the fast path steps aside
    assert sampler(logits, metadata).sampled_token_ids.tolist() == [3, 2, 1]
    assert logits[0, 2] == 5.0  # the caller's logits are not touched
    plain = build([params(), params(), params()], vocab=4)
    assert leaves_logits_unchanged(plain) and plain.logits_processing is None


def test_log_probs_describe_the_biased_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    out = sampler(logits, build([params(logit_bias={1: 1.0}, logprobs=3)], vocab=3))
    expected = torch.log_softmax(logits + torch.tensor([0.0, 1.0, 0.0]), dim=-1)
    assert out.sampled_token_ids.tolist() == [1]
    torch.testing.assert_close(out.sampled_logprobs, expected[0, 1:2])


def test_sampling_rows_draw_from_the_biased_distribution():
    from llmserve.sampling_params import SamplingParams

    logits = torch.zeros(1, 8)
    banned = {token: -100.0 for token in range(7)}  # only token 7 keeps any mass
    metadata = build([SamplingParams(temperature=1.0, logit_bias=banned)], vocab=8)
    assert {sampler(logits, metadata).sampled_token_ids.item() for _ in range(50)} == {7}


def test_rows_see_their_own_tokens_and_biases():
    seen = []

    class Recorder:
        def applies_to(self, p):
            return bool(p.logit_bias)

        def apply(self, logits, rows, row_params, output_token_ids):
            seen.append((list(rows), [list(ids) for ids in output_token_ids]))

    processing = LogitsProcessing.build([params(logit_bias={1: 1}), params()], [[4, 5], [6]])
    processing.work = [(Recorder(), rows) for _, rows in processing.work]
    processing.apply(torch.zeros(2, 8))
    assert seen == [([0], [[4, 5]])]


def test_bias_values_are_checked():
    with pytest.raises(ValueError, match="logit_bias"):
        params(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        params(logit_bias={-1: 1.0})
    assert params(logit_bias={"7": 2}).logit_bias == {7: 2.0}


class _RaisesOnMarkedRows:
    """A processor (as a grammar mask is) that raises, leaving the logits unchanged, when a row it is
    given has the marked bias; on the other rows it adds 10 to token 0."""

    MARK = 3

    def applies_to(self, p) -> bool:
        return bool(p.logit_bias)

    def apply(self, logits, rows, params, output_token_ids) -> None:
        if any(self.MARK in p.logit_bias for p in params):
            raise KeyError("injected processor fault")
        logits[list(rows), 0] += 10.0


def test_a_raising_processor_fails_only_the_rows_that_raise_alone(monkeypatch):
    import llmserve.sample.logits_processors as processors

    monkeypatch.setattr(processors, "PROCESSORS", (_RaisesOnMarkedRows(),))
    batch = [params(logit_bias={1: 0.0}), params(logit_bias={3: 0.0}), params(), params(logit_bias={2: 0.0})]
    processing = LogitsProcessing.build(batch, [[], [], [], []])
    with pytest.raises(KeyError):  # a path that does not fail requests alone: the step fails
        processing.apply(torch.zeros(4, 4))
    processing.isolate_failures = True
    logits = torch.zeros(4, 4)
    processing.apply(logits)
    assert processing.failed_rows == {1}
    assert logits[:, 0].tolist() == [10.0, 0.0, 0.0, 10.0]  # the others got their processing, once


def test_a_processor_that_does_not_raise_fails_no_row():
    processing = LogitsProcessing.build([params(logit_bias={1: 5.0})], [[]])
    processing.apply(torch.zeros(1, 4))
    assert processing.failed_rows == set()
