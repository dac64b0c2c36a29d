"""Bad input never produces a 500 or a traceback: each case is a 4xx with OpenAI's error body."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, MAX_MODEL_LEN

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "hi"}]


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields}


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


def assert_error(response: httpx.Response, status: int, error_type: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param
    return error


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
    pytest.param(completion(prompt="word " * (2 * MAX_MODEL_LEN)), "prompt", id="prompt-too-long"),
    pytest.param({"model": MODEL, "max_tokens": 2}, "prompt", id="prompt-missing"),
    pytest.param(completion(echo=True, logprobs=1), "echo", id="echo-with-logprobs"),
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
    response = http.post("/v1/completions", json=completion(logit_bias={"1": 5}, frobnicate=True))
    assert response.status_code == 200, response.text


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
