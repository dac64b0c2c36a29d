"""SamplingParams validation: every bad value raises ValueError naming the offending field."""

from __future__ import annotations

import pytest

from llmserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_single_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=None).stop == []


def test_top_k_zero_means_disabled() -> None:
    assert SamplingParams(top_k=0).top_k == -1


def test_edge_values_are_accepted() -> None:
    params = SamplingParams(
        temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, logprobs=20, min_tokens=3, max_tokens=3
    )
    assert params.is_greedy
    assert SamplingParams(logprobs=0).logprobs == 0


def test_has_penalties_and_child_seed() -> None:
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    child = SamplingParams(n=3, seed=10).child(2)
    assert child.n == 1 and child.seed == 12
    assert SamplingParams(n=2).child(1).seed is None
