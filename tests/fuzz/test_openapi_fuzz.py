"""Schemathesis against the server's own OpenAPI schema, every operation, positive and negative data.

Gates: no 5xx, every 4xx an OpenAI-style error body, no in-band 500 in a stream. 50 cases per
operation and mode, derandomized (the same cases every run), generation capped at 4 tokens.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation import GenerationMode

from tests.entrypoints.conftest import API_KEY

pytestmark = pytest.mark.server

CASES_PER_OPERATION = 50
MAX_TOKENS = 4
_GENERATING = ("/v1/completions", "/v1/chat/completions")


def _small(case) -> None:
    """Cap generation so the cases stay quick: at most MAX_TOKENS tokens and 2 choices; values of
    another type (negative cases) are left as they are."""
    body = case.body
    if not isinstance(body, dict):
        return
    if case.path == "/v1/responses":  # a tool-call turn is valid input now: it generates too
        value = body.get("max_output_tokens")
        if value is None or (type(value) is int and value > MAX_TOKENS):
            body["max_output_tokens"] = MAX_TOKENS
        return
    if case.path not in _GENERATING:
        return
    for field, cap in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS), ("n", 2)):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[field] = cap
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS


def _check(case, response) -> None:
    where = f"{case.method} {case.path} {json.dumps(case.body, default=str)[:300]}"
    assert response.status_code < 500, f"{where} -> {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error), where
        assert isinstance(error["message"], str) and error["message"], where
    elif "text/event-stream" in response.headers.get("content-type", ""):
        assert '"code":"500"' not in response.text, f"{where} -> {response.text[-300:]}"


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_operation_answers_5xx_or_a_non_openai_error(server, schema, mode):
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {operation.path for operation in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health"} <= paths
    if mode is GenerationMode.NEGATIVE:  # an operation that takes no input has no invalid input
        operations = [op for op in operations if len(op.body) or len(op.query) or len(op.path_parameters)]
        assert {op.path for op in operations} >= set(_GENERATING)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    ran = 0
    for operation in operations:

        @settings(
            max_examples=CASES_PER_OPERATION,
            derandomize=True,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(operation.as_strategy(generation_mode=mode))
        def run(case) -> None:
            nonlocal ran
            _small(case)
            response = case.call(base_url=server.base_url, headers=headers, timeout=60)
            ran += 1
            _check(case, response)

        run()
    assert ran >= len(operations) * 10  # schemathesis stops early only where a schema has few distinct cases
    print(f"{mode.value}: {ran} cases over {len(operations)} operations, no 5xx")
    assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(
            '{"model": "tiny-llama", "prompt": ' + "[" * 50_000 + "]" * 50_000 + "}", id="deep-nesting"
        ),
        pytest.param(
            '{"prompt": "a", "max_tokens": 1, "stop": ' + json.dumps(["s"] * 100_000) + "}", id="huge-array"
        ),
        pytest.param('{"prompt": "' + "x" * 3_000_000 + '", "max_tokens": 1}', id="huge-string"),
        pytest.param('{"prompt": "\\ud800", "max_tokens": 1}', id="lone-surrogate"),
        pytest.param('{"prompt": "a", "temperature": NaN}', id="nan"),
        pytest.param('{"prompt": "a", "max_tokens": 1e400}', id="overflowing-number"),
    ],
)
def test_hostile_bodies_are_4xx_and_the_connection_is_kept(server, raw):
    with httpx.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as http:
        response = http.post(
            "/v1/completions", content=raw.encode(), headers={"Content-Type": "application/json"}
        )
        assert 400 <= response.status_code < 500, response.text[:300]
        assert response.json()["error"]["message"]
        assert http.get("/v1/models").status_code == 200
