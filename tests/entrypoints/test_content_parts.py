"""Chat content parts other than text (images first: Gemma 3 from 4B up is a vision model served for
text here) are a 400 naming the part's type, with OpenAI's error body; text parts still pass."""

from __future__ import annotations

import pydantic
import pytest
from fastapi.exceptions import RequestValidationError

from llmserve.entrypoints.openai.api_server import validation_api_error
from llmserve.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def _chat(*parts: dict) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}]}


def _error_body(body: dict, request_cls: type[pydantic.BaseModel] = ChatCompletionRequest) -> dict:
    """The body the server answers with, as its validation-error handler builds it."""
    with pytest.raises(pydantic.ValidationError) as raised:
        request_cls.model_validate(body)
    errors = [{**error, "loc": ("body", *error["loc"])} for error in raised.value.errors()]
    error = validation_api_error(RequestValidationError(errors))
    assert error.status == 400
    return error.body().model_dump()


@pytest.mark.parametrize(
    ("part", "kind"),
    [
        (IMAGE, "image_url"),
        ({"type": "input_image", "image_url": "https://example.com/a.png"}, "input_image"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio"),
        ({"type": "file", "file": {"file_id": "f"}}, "file"),
    ],
)
def test_non_text_parts_are_400_naming_their_type(part, kind):
    body = _error_body(_chat({"type": "text", "text": "What is in this picture?"}, part))
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert error["message"].startswith("messages.0.content: ")
    assert f"content parts of type {kind!r} are not supported" in error["message"]
    assert "text only" in error["message"]


def test_text_parts_still_pass():
    request = ChatCompletionRequest.model_validate(
        _chat({"type": "text", "text": "a"}, {"type": "text", "text": "b"})
    )
    assert request.messages[0].to_template_message()["content"] == "a\nb"


def test_a_part_without_a_type_keeps_its_own_error():
    assert "content parts of type" not in _error_body(_chat({"text": "x"}))["error"]["message"]


def test_responses_input_images_are_400_too():
    part = {"type": "input_image", "image_url": "https://example.com/a.png"}
    body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, part]}]}
    error = _error_body(body, ResponsesRequest)["error"]
    assert error["param"] == "input"
    assert "content parts of type 'input_image' are not supported" in error["message"]
    text_only = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}]}
    assert ResponsesRequest.model_validate(text_only).input[0].content[0].text == "a"
