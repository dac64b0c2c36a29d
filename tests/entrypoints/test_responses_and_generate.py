"""POST /v1/responses (stateless) through the official client, streamed and not, and POST /v1/generate:
the same greedy text as /v1/chat/completions and /v1/completions, the typed events in order, the
fields this server cannot honour as 400s."""

from __future__ import annotations

import json

import openai
import pytest

from tests.entrypoints.conftest import API_KEY

pytestmark = pytest.mark.server

MODEL = "tiny-llama"
INSTRUCTIONS = "You are terse."
QUESTION = "Say hi."


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def chat_text(client, max_tokens: int) -> tuple[str, str]:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
        max_tokens=max_tokens,
        temperature=0.0,
    )
    return reply.choices[0].message.content, reply.choices[0].finish_reason


def test_response_equals_the_chat_completion(client):
    expected, finish = chat_text(client, 12)
    response = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12, temperature=0.0
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == expected
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens <= 12 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_input_messages_equal_text_input(client):
    by_text = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0.0)
    by_messages = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=6,
        temperature=0.0,
    )
    assert by_messages.output_text == by_text.output_text


def test_streamed_response_events(client):
    kwargs = dict(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12, temperature=0.0
    )
    plain = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [event.type for event in events]
    last = "response.completed" if plain.status == "completed" else "response.incomplete"
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == plain.output_text == events[-4].text
    assert events[-1].response.output_text == plain.output_text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema_constrains_the_output(client, stream):
    """The Responses API's flat json_schema format goes through the same grammar as chat's
    response_format: the tiny random model answers with a document valid against the schema."""
    text_format = {
        "format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}
    }
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0.0, text=text_format)
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        assert events[-1].type == "response.completed"
        text = events[-1].response.output_text
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == text
    else:
        response = client.responses.create(**kwargs)
        assert response.status == "completed"
        text = response.output_text
    document = json.loads(text)
    assert set(document) == {"answer", "sure"}
    assert document["answer"] in ("yes", "no") and isinstance(document["sure"], bool)


def test_text_format_json_object_starts_an_object(client):
    response = client.responses.create(
        model=MODEL,
        input=QUESTION,
        max_output_tokens=8,
        temperature=0.0,
        text={"format": {"type": "json_object"}},
    )
    assert response.output_text.startswith("{")


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "stored responses are not supported"),
        ({"store": True}, "store", "stored responses are not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools", "function"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "needs a schema"),
        (
            {
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "not": {}}}
                }
            },
            "text",
            "not",
        ),
        ({"reasoning": {"effort": "low"}}, "reasoning", "not supported"),
        ({"input": []}, "input", "empty"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"model": "other"}, "model", "does not exist"),
    ],
)
def test_unsupported_response_fields_are_400s(server, extra, param, words):
    with server.http() as http:
        response = http.post("/v1/responses", json={"model": MODEL, "input": QUESTION, **extra})
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_generate_equals_the_completion(client, server):
    prompt = "The quick brown fox"
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0)
    with server.http() as http:
        body = http.post("/v1/generate", json={"prompt": prompt, "max_tokens": 8, "temperature": 0.0}).json()
    assert set(body) == {"text", "tokens_generated", "latency_ms", "tokens_per_second", "finish_reason"}
    assert body["text"] == completion.choices[0].text
    assert body["tokens_generated"] == completion.usage.completion_tokens
    assert body["finish_reason"] == completion.choices[0].finish_reason
    assert 1 <= body["tokens_generated"] <= 8 and body["latency_ms"] > 0
    assert body["tokens_per_second"] == pytest.approx(body["tokens_generated"] / body["latency_ms"] * 1000)


def test_generate_stream(server):
    request = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0.0}
    with server.http() as http:
        plain = http.post("/v1/generate", json=request).json()
        with http.stream("POST", "/v1/generate", json={**request, "stream": True}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [
                line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")
            ]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    final = events[-1]
    assert final["done"] is True and all(not event["done"] for event in events[:-1])
    assert "".join(event["text"] for event in events[:-1]) == final["text"] == plain["text"]
    assert final["tokens_generated"] == plain["tokens_generated"]
    assert [e["tokens_generated"] for e in events] == sorted(e["tokens_generated"] for e in events)
    assert final["latency_ms"] > 0 and final["finish_reason"] == plain["finish_reason"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"max_tokens": 8}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "max_tokens": "8"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
    ],
)
def test_generate_bad_input_is_400(server, body, param):
    with server.http() as http:
        response = http.post("/v1/generate", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
