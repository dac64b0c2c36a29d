import itertools

import pytest

from llmserve.request import Request
from llmserve.sampling_params import SamplingParams

_ids = itertools.count()


@pytest.fixture
def make_request():
    def make(
        num_prompt_tokens: int, max_tokens: int = 16, tokens: list[int] | None = None, **params
    ) -> Request:
        """A request with distinct tokens (no accidental prefix-cache hits) unless `tokens` is given."""
        index = next(_ids)
        return Request(
            f"r{index}",
            tokens
            if tokens is not None
            else list(range(1000 * index + 3, 1000 * index + 3 + num_prompt_tokens)),
            SamplingParams(max_tokens=max_tokens, **params),
            eos_token_ids=(2,),
        )

    return make
