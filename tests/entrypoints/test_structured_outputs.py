"""Structured outputs through the server with the official openai client: response_format (json_object,
json_schema, the client's pydantic parse), vLLM's structured_outputs and guided_* fields, on chat and
completions, streamed or not, with n > 1, seeds, logprobs, stop strings and priority; greedy outputs
unchanged by speculative decoding (ngram, draft_head); and each refusal a 400 naming its field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from enum import StrEnum

import openai
import pytest
from pydantic import BaseModel, Field

from tests.entrypoints.conftest import ServerProcess, start_server, tiny_server_args

pytestmark = pytest.mark.server

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 256
DEFAULT_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "128MiB"]


class Review(BaseModel):
    title: str
    summary: str
    verdict: str


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str
    zip_code: int


class Person(BaseModel):
    name: str
    age: int
    favorite: Color
    address: Address
    hobbies: list[str] = Field(max_length=3)


@pytest.fixture(scope="module")
def default_server(tmp_path_factory) -> Iterator[ServerProcess]:
    process = start_server(DEFAULT_ARGS, tmp_path_factory.mktemp("so") / "server.log")
    yield process
    process.stop()


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def client(default_server) -> openai.OpenAI:
    return client_of(default_server)


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.mark.slow
def test_parse_a_pydantic_model_on_20_seeded_samples_at_temperature_1(client):
    choices = []
    for seed in (7, 17):  # n=10 from seed s samples with seeds s..s+9: 20 distinct seeds
        try:
            completion = client.chat.completions.parse(
                model=MODEL,
                messages=ask(
                    "Review the movie Alien in JSON with a title, a one-sentence summary and a verdict."
                ),
                response_format=Review,
                temperature=1.0,
                n=10,
                seed=seed,
                max_tokens=MAX_TOKENS,
            )
        except openai.LengthFinishReasonError as cut:  # a sample that rambled past max_tokens
            completion = cut.completion
        choices += completion.choices
    assert len(choices) == 20
    parsed = [choice for choice in choices if choice.finish_reason == "stop"]
    assert len(parsed) >= 15, [choice.message.content for choice in choices]
    for choice in choices:
        if choice.finish_reason == "stop":
            Review.model_validate_json(choice.message.content)
        else:  # cut inside the JSON: a "length" finish, never a "stop" with broken JSON
            assert choice.finish_reason == "length"
            with pytest.raises(ValueError):
                Review.model_validate_json(choice.message.content)


@pytest.mark.slow
def test_nested_objects_arrays_enums_and_required_fields_validate(client):
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=ask("Invent a person as JSON."),
        response_format=Person,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)


@pytest.mark.slow
def test_json_schema_streamed_with_logprobs_and_priority(client):
    bounded = {"type": "string", "maxLength": 40}
    schema = {
        "type": "object",
        "properties": {"name": bounded, "sound": bounded},
        "required": ["name", "sound"],
    }
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ask("Give me a JSON object describing a cat."),
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}},
        temperature=0.7,
        seed=1,
        max_tokens=300,
        stream=True,
        logprobs=True,
        top_logprobs=2,
        extra_body={"priority": 5},
    )
    text, finish, logprobs = "", None, []
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            logprobs += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    assert finish == "stop"
    assert set(json.loads(text)) == {"name", "sound"}
    assert logprobs and all(entry.logprob > -1e4 for entry in logprobs)  # chosen tokens were allowed


@pytest.mark.slow
def test_json_object_gives_an_object(client):
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ask("Give me a JSON object with a cat's name."),
        response_format={"type": "json_object"},
        temperature=0.0,
        max_tokens=MAX_TOKENS,
    )
    choice = completion.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":  # greedy may also loop inside a string until max_tokens
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.slow
def test_a_json_cut_by_max_tokens_ends_with_length(client):
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ask("Invent a person as JSON."),
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True},
        },
        temperature=0.0,
        max_tokens=5,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and completion.usage.completion_tokens == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
        {"guided_regex": r"[0-9]{3}-[0-9]{4}"},
    ],
)
def test_regex_on_completions_and_chat(client, extra):
    pattern = re.compile(r"[0-9]{3}-[0-9]{4}")
    completion = client.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=20,
        temperature=1.0,
        seed=5,
        n=3,
        extra_body=extra,
    )
    assert all(pattern.fullmatch(choice.text) for choice in completion.choices)
    chat = client.chat.completions.create(
        model=MODEL, messages=ask("Your phone number?"), max_tokens=20, temperature=0.0, extra_body=extra
    )
    assert pattern.fullmatch(chat.choices[0].message.content)


@pytest.mark.slow
def test_choice_and_grammar_with_a_stop_string(client):
    choices = ["positive", "negative", "neutral"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        completion = client.chat.completions.create(
            model=MODEL,
            messages=ask("Sentiment of 'I love it'?"),
            temperature=1.0,
            seed=2,
            n=5,
            max_tokens=10,
            extra_body=extra,
        )
        assert {choice.message.content for choice in completion.choices} <= set(choices)
    grammar = 'root ::= "The answer is " [0-9]+ "." " Done"'
    completion = client.completions.create(
        model=MODEL,
        prompt="What is 2 + 2?",
        max_tokens=30,
        temperature=0.0,
        stop=[" Done"],
        extra_body={"guided_grammar": grammar},
    )
    assert re.fullmatch(r"The answer is [0-9]+\.", completion.choices[0].text)
    assert completion.choices[0].finish_reason == "stop"


SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True},
}
SPEC_PROMPT = ask("Invent a person named Ada Lovelace as JSON.")
DETERMINISTIC_FLOAT32 = ["--dtype", "float32", "--deterministic"]


@pytest.fixture(scope="module")
def float32_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """float32 and batch invariant: greedy tokens compared across speculation on and off must hinge
    neither on bf16 rounding nor on this server's prefix-cache hit on the prompt (a later test's)."""
    process = start_server(
        [*DEFAULT_ARGS, *DETERMINISTIC_FLOAT32], tmp_path_factory.mktemp("so32") / "server.log"
    )
    yield process
    process.stop()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_head"])
def test_greedy_json_schema_is_unchanged_by_speculative_decoding(float32_server, method, tmp_path):
    def create(server: ServerProcess):
        return client_of(server).chat.completions.create(
            model=MODEL, messages=SPEC_PROMPT, response_format=SCHEMA_FORMAT, temperature=0.0, max_tokens=200
        )

    plain = create(float32_server)
    args = [*DEFAULT_ARGS, *DETERMINISTIC_FLOAT32, "--speculative-method", method]
    server = start_server([*args, "--speculative-disable-batch-size", "0"], tmp_path / "server.log")
    try:
        spec = create(server)
    finally:
        server.stop()
    assert spec.choices[0].message.content == plain.choices[0].message.content
    Person.model_validate_json(spec.choices[0].message.content)
    assert spec.usage.model_extra["speculative"]["num_draft_tokens"] > 0


# -- refusals, on the tiny model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_budget_server(tiny_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    args = tiny_server_args(tiny_model_dir, "--structured-outputs-compile-timeout", "0.001")
    process = start_server(args, tmp_path_factory.mktemp("so-tiny") / "server.log")
    yield process
    process.stop()


def big_schema() -> dict:
    props = {
        f"p{i}": {
            "type": "object",
            "properties": {f"q{j}": {"type": "string", "pattern": "[a-z]{3,9}"} for j in range(20)},
        }
        for i in range(40)
    }
    return {"type": "object", "properties": props, "required": list(props)}


def refusal(server: ServerProcess, body: dict, path: str = "/v1/chat/completions") -> dict:
    base = {"model": "tiny-llama", "max_tokens": 4}
    if path.endswith("chat/completions"):
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    with server.http() as http:
        response = http.post(path, json={**base, **body})
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_a_grammar_over_the_compile_budget_is_a_400(tiny_budget_server):
    body = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": big_schema()}}
    }
    error = refusal(tiny_budget_server, body)
    assert error["param"] == "response_format" and "did not compile within" in error["message"]
    with tiny_budget_server.http() as http:  # the server still serves
        assert (
            http.post(
                "/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
            ).status_code
            == 200
        )


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "response_format",
            "'not'",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", ""),
        ({"guided_regex": "(?<=a)b"}, "guided_regex", "ookbehind"),
        ({"structured_outputs": {"grammar": 'root ::= "a" | b'}}, "structured_outputs", "not defined"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"json": {}, "whitespace_pattern": " "}}, "structured_outputs", ""),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "cannot be combined"),
        ({"guided_json": "{not json"}, "guided_json", ""),
    ],
)
def test_unsupported_or_malformed_constraints_are_400s_naming_the_field(server, body, param, message):
    for path in ("/v1/chat/completions", "/v1/completions"):
        error = refusal(server, body, path)
        assert param in (error["param"] or "") and message in error["message"], error
