"""Every request field the installed openai client defines is classed in docs/server.md, and each
class holds: implemented fields are declared by our models, "no effect" fields change nothing, and
400 fields are refused by name."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from llmserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## OpenAI's request fields"
ENDPOINTS = {
    "completions": ("/v1/completions", CompletionRequest, completion_create_params),
    "chat": ("/v1/chat/completions", ChatCompletionRequest, chat_create_params),
}
BASE = {
    "completions": {"model": "tiny-llama", "prompt": "hello", "max_tokens": 3, "temperature": 0.0},
    "chat": {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0.0,
    },
}
# a value that asks for something, per field of the "no effect" and "400" classes
SAMPLES = {
    "user": "user-1",
    "safety_identifier": "hashed-user-1",
    "metadata": {"team": "search"},
    "store": True,
    "service_tier": "flex",
    "prompt_cache_key": "conversation-7",
    "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
    "prompt_cache_retention": "24h",
    "parallel_tool_calls": False,
    "best_of": 3,
    "suffix": " and that was it.",
    "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "get_weather"}}],
    "tool_choice": "auto",
    "functions": [{"name": "get_weather"}],
    "function_call": "auto",
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "hello"},
    "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"},
    "reasoning_effort": "low",
    "verbosity": "low",
}


@dataclass(frozen=True)
class Row:
    field: str
    endpoints: tuple[str, ...]
    kind: str
    note: str

    @property
    def accepted(self) -> object:
        """The value a 400 field still accepts, from a note starting "`value` accepted"."""
        match = re.match(r"`([^`]+)` accepted", self.note)
        return json.loads(match.group(1)) if match else None


def section() -> str:
    text = (ROOT / "docs" / "server.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end != -1 else len(text)]


def table() -> list[Row]:
    rows = []
    for line in section().splitlines():
        if not line.startswith("| `"):
            continue
        field, endpoint, kind, note = (cell.strip() for cell in line.strip("|").split("|"))
        endpoints = tuple(ENDPOINTS) if endpoint == "both" else (endpoint,)
        rows.append(Row(field.strip("`"), endpoints, kind, note))
    return rows


def openai_fields(module) -> set[str]:
    """The keys of the client's create params, streaming or not."""
    return {
        key
        for params in (module.CompletionCreateParamsNonStreaming, module.CompletionCreateParamsStreaming)
        for key in params.__required_keys__ | params.__optional_keys__
    }


ROWS = table()
BY_KIND = {kind: [row for row in ROWS if row.kind == kind] for kind in ("implemented", "no effect", "400")}


def cases(kind: str) -> list:
    return [
        pytest.param(row, endpoint, id=f"{row.field}-{endpoint}")
        for row in BY_KIND[kind]
        for endpoint in row.endpoints
    ]


def test_the_table_is_for_the_pinned_client():
    version = metadata.version("openai")
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert f"openai=={version}" in dev
    assert f"`openai=={version}`" in section()


def test_every_openai_field_has_one_row_with_its_endpoints():
    fields = [row.field for row in ROWS]
    assert len(fields) == len(set(fields)), "a field has two rows"
    assert {row.kind for row in ROWS} <= set(BY_KIND), "a row's class is not one of the three"
    for endpoint, (_, _, params) in ENDPOINTS.items():
        assert openai_fields(params) == {row.field for row in ROWS if endpoint in row.endpoints}, endpoint


@pytest.mark.parametrize(("row", "endpoint"), cases("implemented"))
def test_implemented_fields_are_declared(row, endpoint):
    model = ENDPOINTS[endpoint][1]
    assert row.field in model.model_fields and row.field not in model.unsupported_fields()


def test_unsupported_declarations_match_the_table():
    for endpoint, (_, model, _) in ENDPOINTS.items():
        refused = {row.field for row in BY_KIND["400"] if endpoint in row.endpoints}
        assert model.unsupported_fields() == refused, endpoint


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


@pytest.fixture(scope="module")
def baseline(http):
    """Each endpoint's greedy reply to the base request."""
    replies = {}
    for endpoint, (path, _, _) in ENDPOINTS.items():
        response = http.post(path, json=BASE[endpoint])
        assert response.status_code == 200, response.text
        replies[endpoint] = reply_text(endpoint, response.json())
    return replies


def reply_text(endpoint: str, body: dict) -> str:
    choice = body["choices"][0]
    return choice["text"] if endpoint == "completions" else choice["message"]["content"]


@pytest.mark.server
@pytest.mark.parametrize(("row", "endpoint"), cases("no effect"))
def test_no_effect_fields_are_accepted_and_change_nothing(http, baseline, row, endpoint):
    path = ENDPOINTS[endpoint][0]
    response = http.post(path, json={**BASE[endpoint], row.field: SAMPLES[row.field]})
    assert response.status_code == 200, response.text
    assert reply_text(endpoint, response.json()) == baseline[endpoint]


@pytest.mark.server
@pytest.mark.parametrize(("row", "endpoint"), cases("400"))
def test_refused_fields_are_400_naming_the_field(http, row, endpoint):
    path = ENDPOINTS[endpoint][0]
    response = http.post(path, json={**BASE[endpoint], row.field: SAMPLES[row.field]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == row.field and error["type"] == "invalid_request_error"
    assert "not supported" in error["message"]


@pytest.mark.server
@pytest.mark.parametrize(("row", "endpoint"), cases("400"))
def test_refused_fields_accept_null_and_the_value_that_asks_for_nothing(http, baseline, row, endpoint):
    path = ENDPOINTS[endpoint][0]
    values = [None] if row.accepted is None else [None, row.accepted]
    for value in values:
        response = http.post(path, json={**BASE[endpoint], row.field: value})
        assert response.status_code == 200, f"{row.field}={value!r}: {response.text}"
        assert reply_text(endpoint, response.json()) == baseline[endpoint]


@pytest.mark.server
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_latency_target_fields_reach_the_scheduler_and_change_no_token(http, baseline, endpoint):
    """llmserve's own fields (docs/server.md): a request's TTFT / TPOT targets change when its tokens are
    computed, never which; a value that is not a positive number of ms is a 400 naming the field."""
    path, model, _ = ENDPOINTS[endpoint]
    targets = {"ttft_target_ms": 250.0, "tpot_target_ms": 20}
    params = model(**BASE[endpoint], **targets).to_sampling_params(max_tokens=3)
    assert (params.ttft_target_ms, params.tpot_target_ms) == (250.0, 20.0)
    response = http.post(path, json={**BASE[endpoint], **targets})
    assert response.status_code == 200, response.text
    assert reply_text(endpoint, response.json()) == baseline[endpoint]
    for field, value in (("ttft_target_ms", 0), ("tpot_target_ms", -5), ("tpot_target_ms", "fast")):
        response = http.post(path, json={**BASE[endpoint], field: value})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field
