import itertools

import pytest

from llmserve.request import Request
from llmserve.sampling_params import SamplingParams

_ids = itertools.count()


@pytest.fixture
def make_request():
    def make(num_prompt_tokens: int, max_tokens: int = 16, **params) -> Request:
        return Request(
            f"r{next(_ids)}",
            list(range(3, 3 + num_prompt_tokens)),
            SamplingParams(max_tokens=max_tokens, **params),
            eos_token_ids=(2,),
        )

    return make
