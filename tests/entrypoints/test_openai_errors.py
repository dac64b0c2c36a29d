"""Bad input never produces a 500 or a traceback: each case is a 4xx with OpenAI's error body."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import pytest

from llmserve.entrypoints.openai import protocol
from llmserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from llmserve.entrypoints.openai.serving import ApiError
from llmserve.entrypoints.openai.serving_chat import ChatHandler
from tests.entrypoints.conftest import API_KEY, MAX_MODEL_LEN
from tests.helpers import TINY_LLAMA_CONFIG

pytestmark = pytest.mark.server

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "hi"}]
VOCAB_SIZE = TINY_LLAMA_CONFIG["vocab_size"]


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields}


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


def post_raw(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """POST with Python's own JSON encoder, which writes Infinity/NaN and escapes lone surrogates
    (httpx's refuses both)."""
    return http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def client_port(response: httpx.Response) -> int:
    """The local port of the connection that carried `response`: the same port, the same connection."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def assert_error(response: httpx.Response, status: int, error_type: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["message"]
    assert_no_internals(error["message"])
    if param is not None:
        assert error["param"] == param
    return error


# What an error body must never show: a traceback, a source path, a class name (ours or Python's).
_INTERNALS = re.compile(
    r"Traceback|File \"|\.py\b|site-packages|/work/|llmserve\.|<class|object at 0x|\b\w+(Error|Exception)\b"
)
_MODEL_NAMES = {
    name for name, value in vars(protocol).items() if isinstance(value, type) and name[0].isupper()
}


def assert_no_internals(message: str) -> None:
    assert not _INTERNALS.search(message), message
    assert not _MODEL_NAMES & set(re.findall(r"\w+", message)), message


def test_internal_errors_in_a_stream_show_no_internals():
    from llmserve.entrypoints.openai.serving import sse_error

    event = json.loads(sse_error(KeyError("/work/llmserve/engine/x.py: bad")).removeprefix("data: "))
    assert event["error"] == {
        "message": "internal server error",
        "type": "server_error",
        "param": None,
        "code": "500",
    }


BAD_COMPLETIONS = [
    pytest.param(completion(max_tokens="5"), "max_tokens", id="max_tokens-wrong-type"),
    pytest.param(completion(max_tokens=0), "max_tokens", id="max_tokens-zero"),
    pytest.param(completion(max_tokens=MAX_MODEL_LEN), "max_tokens", id="max_tokens-past-context"),
    pytest.param(completion(temperature=-0.5), "temperature", id="temperature-negative"),
    pytest.param(completion(top_p=0.0), "top_p", id="top_p-zero"),
    pytest.param(completion(top_p=1.5), "top_p", id="top_p-above-one"),
    pytest.param(completion(top_k=-2), "top_k", id="top_k"),
    pytest.param(completion(min_p=2.0), "min_p", id="min_p"),
    pytest.param(completion(n=0), "n", id="n-zero"),
    pytest.param(completion(n=17), "n", id="n-too-large"),
    pytest.param(completion(logprobs=21), "logprobs", id="logprobs-too-large"),
    pytest.param(completion(presence_penalty=3.0), "presence_penalty", id="presence_penalty"),
    pytest.param(completion(repetition_penalty=0.0), "repetition_penalty", id="repetition_penalty"),
    pytest.param(completion(stop=[""]), "stop", id="stop-empty-string"),
    pytest.param(completion(stop=5), "stop", id="stop-wrong-type"),
    pytest.param(completion(seed=-1), "seed", id="seed-negative"),
    pytest.param(completion(min_tokens=3), "min_tokens", id="min_tokens-above-max_tokens"),
    pytest.param(
        completion(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options",
        id="stream_options-wrong-type",
    ),
    pytest.param(
        completion(stream_options={"include_usage": True}),
        "stream_options",
        id="stream_options-without-stream",
    ),
    pytest.param(completion(prompt=""), "prompt", id="prompt-empty-string"),
    pytest.param(completion(prompt=[]), "prompt", id="prompt-empty-list"),
    pytest.param(completion(prompt=[[]]), "prompt", id="prompt-empty-token-list"),
    pytest.param(completion(prompt=[1.5]), "prompt", id="prompt-floats"),
    pytest.param(completion(prompt=[10**9]), "prompt", id="prompt-token-out-of-vocab"),
    pytest.param(completion(prompt=[VOCAB_SIZE]), "prompt", id="prompt-token-vocab-size"),
    pytest.param(completion(prompt=[1, -1]), "prompt", id="prompt-token-negative"),
    pytest.param(completion(prompt=[2**70]), "prompt", id="prompt-token-past-int64"),
    pytest.param(completion(prompt=[[1], [VOCAB_SIZE]], echo=True), "prompt", id="prompt-token-echoed"),
    pytest.param(completion(stop=["x"] * 17), "stop", id="stop-too-many"),
    pytest.param(completion(priority=2**63), "priority", id="priority-past-int64"),
    pytest.param(completion(min_tokens=10**30), "min_tokens", id="min_tokens-huge"),
    pytest.param(completion(max_tokens=10**30), "max_tokens", id="max_tokens-huge"),
    pytest.param(completion(prompt="word " * (2 * MAX_MODEL_LEN)), "prompt", id="prompt-too-long"),
    pytest.param({"model": MODEL, "max_tokens": 2}, "prompt", id="prompt-missing"),
    pytest.param(completion(n=2, best_of=1), "best_of", id="best_of-below-n"),
    pytest.param(completion(stop_token_ids=[-1]), "stop_token_ids", id="stop_token_ids-negative"),
    pytest.param(completion(stop_token_ids=[VOCAB_SIZE]), "stop_token_ids", id="stop_token_ids-past-vocab"),
    pytest.param(completion(prompt_logprobs=21), "prompt_logprobs", id="prompt_logprobs-too-many"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests_are_400(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, "invalid_request_error", param)


BAD_CHATS = [
    pytest.param(chat(messages=[]), "messages", id="messages-empty"),
    pytest.param({"model": MODEL}, "messages", id="messages-missing"),
    pytest.param(chat(messages=[{"role": "wizard", "content": "hi"}]), "messages", id="role-unknown"),
    pytest.param(chat(messages=[{"role": "user", "content": 5}]), "messages", id="content-wrong-type"),
    pytest.param(
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
        "messages",
        id="content-image-part",
    ),
    pytest.param(chat(max_completion_tokens=0), "max_completion_tokens", id="max_completion_tokens-zero"),
    pytest.param(chat(logprobs="yes"), "logprobs", id="logprobs-wrong-type"),
    pytest.param(chat(top_logprobs=2), "top_logprobs", id="top_logprobs-without-logprobs"),
    pytest.param(chat(logprobs=True, top_logprobs=21), "top_logprobs", id="top_logprobs-too-large"),
    pytest.param(
        chat(messages=[{"role": "user", "content": "word " * (2 * MAX_MODEL_LEN)}]),
        "messages",
        id="messages-too-long",
    ),
    pytest.param(chat(temperature="hot"), "temperature", id="temperature-wrong-type"),
    pytest.param(
        chat(messages=[{"role": "tool", "content": "x"}]), "messages", id="tool-without-tool_call_id"
    ),
    pytest.param(chat(messages=[{"role": 1, "content": "x"}]), "messages", id="role-wrong-type"),
    pytest.param(chat(messages=[{"content": "x"}]), "messages", id="role-missing"),
    pytest.param(chat(messages=["hi"]), "messages", id="message-not-an-object"),
    pytest.param(chat(messages={"role": "user", "content": "hi"}), "messages", id="messages-not-a-list"),
    pytest.param(
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages", id="text-part-no-text"
    ),
    pytest.param(
        chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]),
        "messages",
        id="content-audio-part",
    ),
    pytest.param(
        chat(messages=[{"role": "user", "content": [{"text": "x"}]}]), "messages", id="part-no-type"
    ),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS)
def test_bad_chat_requests_are_400(http, body, param):
    assert_error(http.post("/v1/chat/completions", json=body), 400, "invalid_request_error", param)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"", b'"a string"'])
def test_malformed_bodies_are_400(http, path, content):
    response = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert_error(response, 400, "invalid_request_error")


def test_unknown_fields_are_ignored(http):
    """Fields OpenAI does not define; those it does define are classed in test_request_fields.py."""
    response = http.post("/v1/completions", json=completion(frobnicate=True, extra={"a": [1]}))
    assert response.status_code == 200, response.text


def _float_fields(model) -> list[str]:
    return [name for name, field in model.model_fields.items() if field.annotation in (float, float | None)]


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize(
    ("path", "body", "fields"),
    [
        ("/v1/completions", completion(), _float_fields(CompletionRequest)),
        ("/v1/chat/completions", chat(), _float_fields(ChatCompletionRequest)),
    ],
    ids=["completions", "chat"],
)
def test_non_finite_numbers_are_400_naming_the_field(http, path, body, fields, value):
    assert "temperature" in fields and "repetition_penalty" in fields
    for field in fields:
        error = assert_error(
            post_raw(http, path, {**body, field: value}), 400, "invalid_request_error", field
        )
        assert "finite" in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", float("inf")),
        ("prompt", [1, float("nan")]),
        ("stop", [float("inf")]),
        ("n", float("nan")),
    ],
)
def test_non_finite_numbers_where_others_belong_are_400(http, field, value):
    assert_error(
        post_raw(http, "/v1/completions", completion(**{field: value})), 400, "invalid_request_error", field
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 1e300),
        ("temperature", 2e-5),  # just above the greedy threshold: logits scaled by 5e4
        ("repetition_penalty", 1e300),
        ("repetition_penalty", 1e-300),
        ("top_k", 10**30),
    ],
)
@pytest.mark.parametrize("seed", [None, 7])
def test_extreme_finite_numbers_still_generate(http, field, value, seed):
    """Past float32's range the engine's tensors hold inf or 0; sampling must still succeed."""
    response = post_raw(
        http, "/v1/completions", completion(max_tokens=4, seed=seed, ignore_eos=True, **{field: value})
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


SURROGATE_REQUESTS = [
    pytest.param("/v1/completions", completion(prompt="\ud800"), "prompt", id="prompt"),
    pytest.param(
        "/v1/completions", completion(prompt="ok \udfff ok", stream=True), "prompt", id="prompt-stream"
    ),
    pytest.param("/v1/completions", completion(prompt=["fine", "a\udc00"]), "prompt", id="prompt-list"),
    pytest.param("/v1/completions", completion(stop=["\ud83d"]), "stop", id="stop"),
    pytest.param("/v1/chat/completions", chat(stop="a\ud800"), "stop", id="chat-stop"),
    pytest.param(
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "\ud800"}]),
        "messages",
        id="message",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(messages=[{"role": "system", "content": [{"type": "text", "text": "x\udbff"}]}]),
        "messages",
        id="message-part",
    ),
    pytest.param("/tokenize", {"prompt": "\ud800"}, "prompt", id="tokenize-prompt"),
    pytest.param(
        "/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages", id="tokenize-messages"
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_REQUESTS)
def test_lone_surrogates_are_400_and_keep_the_connection(http, path, body, param):
    before = http.post("/v1/completions", json=completion())
    error = assert_error(post_raw(http, path, body), 400, "invalid_request_error", param)
    assert "surrogate" in error["message"]
    after = http.post("/v1/completions", json=completion())
    assert after.status_code == 200, after.text
    assert client_port(after) == client_port(before), "the server closed the connection"


def test_lone_surrogate_in_a_quoted_value_is_escaped(http):
    error = assert_error(
        post_raw(http, "/v1/completions", completion(model="m\ud800")), 404, "not_found_error"
    )
    assert "\\ud800" in error["message"]


def test_error_messages_quoting_a_surrogate_still_serialize():
    body = ApiError("the template said: \ud800").body().model_dump_json()
    assert json.loads(body)["error"]["message"] == "the template said: \\ud800"


def test_body_that_is_not_utf8_is_400(http):
    content = b'{"model": "tiny-llama", "prompt": "\xff\xfe"}'
    response = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert_error(response, 400, "invalid_request_error")


@pytest.mark.parametrize(
    "stop",
    [
        ["\x00", "\u0301", "\U0001f600", "\uffff", "\u202e", "\ufffd"],  # NUL, combining, emoji, ...
        ["x" * 100_000],  # far longer than anything generated
        ["\u00e9", "e\u0301"],  # the same letter precomposed and decomposed
    ],
    ids=["odd-unicode", "very-long", "normal-forms"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_odd_stop_strings_are_accepted(http, stop, stream):
    response = http.post("/v1/completions", json=completion(stop=stop, stream=stream, max_tokens=4))
    assert response.status_code == 200, response.text
    if stream:
        assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text


def test_token_id_prompts_decode_for_echo(http):
    """Echoing a token-id prompt decodes it, special tokens and the last id of the vocabulary too."""
    response = http.post("/v1/completions", json=completion(prompt=[0, 1, 2, VOCAB_SIZE - 1], echo=True))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].startswith("<|endoftext|><|im_start|><|im_end|>")


def test_detokenize_takes_every_vocabulary_id_and_no_other(http):
    response = http.post("/detokenize", json={"tokens": [0, VOCAB_SIZE - 1]})
    assert response.status_code == 200, response.text
    assert_error(
        http.post("/detokenize", json={"tokens": [VOCAB_SIZE]}), 400, "invalid_request_error", "tokens"
    )
    assert_error(http.post("/detokenize", json={"tokens": [2**70]}), 400, "invalid_request_error", "tokens")


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "assistant", "content": []}, {"role": "user", "content": "x"}],
    ],
    ids=["content-missing", "content-null", "content-no-parts"],
)
def test_messages_without_content_render_as_empty(http, messages):
    response = http.post("/v1/chat/completions", json=chat(messages=messages))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "template",
    [
        "{{ raise_exception('roles must alternate') }}",  # a template's own check
        "{{ messages[0]['content'] + 1 }}",  # a template that breaks on this conversation
        "{{ messages[0].nope.deeper }}",  # an attribute of something undefined
    ],
    ids=["raise_exception", "type-error", "undefined"],
)
def test_chat_template_errors_are_400(tiny_model_dir, template):
    from llmserve.entrypoints.openai.chat_options import ChatOptions
    from llmserve.model_loader import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.hf.chat_template = template
    ctx = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer), chat_options=ChatOptions())
    handler = ChatHandler(ctx)
    with pytest.raises(ApiError) as raised:
        handler.render([{"role": "user", "content": "hi"}])
    assert raised.value.status == 400 and raised.value.param == "messages"
    assert "template" in raised.value.message


def test_null_means_not_set(http):
    nulls = dict.fromkeys(
        ["n", "stream", "stream_options", "stop", "seed", "temperature", "logprobs", "echo", "user"]
    )
    response = http.post("/v1/completions", json=completion(**nulls))
    assert response.status_code == 200, response.text
    response = http.post(
        "/v1/chat/completions", json=chat(logprobs=None, top_logprobs=None, n=None, stop=None)
    )
    assert response.status_code == 200, response.text


def test_unknown_model_is_404(http):
    for path, body in (
        ("/v1/completions", completion(model="gpt-9")),
        ("/v1/chat/completions", chat(model="x")),
    ):
        error = assert_error(http.post(path, json=body), 404, "not_found_error", "model")
        assert error["code"] == "model_not_found"


def test_unknown_route_and_method_have_the_error_body(http):
    assert_error(http.get("/v1/nothing"), 404, "not_found_error")
    assert_error(http.get("/v1/completions"), 405, "invalid_request_error")


def test_body_over_the_limit_is_413(http):
    response = http.post("/v1/completions", json=completion(prompt="x" * (5 * 2**20)))
    assert_error(response, 413, "invalid_request_error")


def test_bad_detokenize_ids_are_400(http):
    assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400, "invalid_request_error", "tokens")
    assert_error(http.post("/tokenize", json={}), 400, "invalid_request_error", "messages")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    ],
)
def test_api_routes_need_the_key(server, headers, method, path):
    response = httpx.request(method, server.base_url + path, headers=headers, json=completion(), timeout=10)
    error = assert_error(response, 401, "authentication_error")
    assert error["code"] == "invalid_api_key"


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    metrics = httpx.get(server.base_url + "/metrics", timeout=10)
    assert metrics.status_code == 200 and "llmserve:num_requests_running" in metrics.text


def test_server_still_serves_after_all_that(http):
    response = http.post("/v1/completions", json=completion())
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in (
        "stop",
        "length",
    )
