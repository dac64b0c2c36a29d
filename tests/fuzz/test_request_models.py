"""Property tests on the request models: any JSON value is a request or a 400, never another error."""

from __future__ import annotations

import json

import pydantic
from fastapi.exceptions import RequestValidationError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.entrypoints.openai.api_server import validation_api_error
from llmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

MODELS = [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest]

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)  # lone surrogates included
)
json_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "logit_bias",
    "timeout",
    "tokens",
    "priority",
]
# bodies that look like requests: known field names with arbitrary values
request_like = st.dictionaries(st.sampled_from(_FIELDS), json_values, max_size=8)


def _validate(model, body: object, raw: str | None = None) -> bool:
    """Validate as FastAPI does; a failure must become a 400 ApiError with a message. Whether the
    body was accepted (any other exception fails the test: it would be a 500)."""
    try:
        model.model_validate_json(json.dumps(body) if raw is None else raw)
        return True
    except pydantic.ValidationError as error:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in error.errors()]
        api_error = validation_api_error(RequestValidationError(errors))
        assert api_error.status == 400 and api_error.message
        json.dumps(api_error.body().model_dump())  # serializable, even quoting a lone surrogate
        return False


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=json_values | request_like)
def test_any_json_value_is_a_request_or_a_400(body):
    # _validate fails the test on any exception but a ValidationError that becomes a 400 with a message
    accepted = [_validate(model, body) for model in MODELS]
    if not isinstance(body, dict):
        assert not any(accepted), f"a JSON {type(body).__name__} passed as a request"


@settings(max_examples=30, derandomize=True, deadline=None)
@given(depth=st.integers(min_value=1, max_value=20_000))
def test_deep_nesting_is_a_400(depth):
    raw = '{"model": "m", "prompt": ' + "[" * depth + "]" * depth + "}"  # past any recursion limit
    assert not _validate(CompletionRequest, None, raw)


def test_huge_arrays_and_strings_validate_without_error():
    assert _validate(CompletionRequest, {"model": "m", "prompt": [1] * 100_000, "stop": ["s"] * 16})
    assert not _validate(CompletionRequest, {"prompt": [1], "stop": ["s"] * 1000})  # at most 16 stops
    # parses; the context-length check turns such a max_tokens into a 400 (test_openai_errors.py)
    assert _validate(CompletionRequest, {"prompt": "x" * 1_000_000, "max_tokens": 2**64})
