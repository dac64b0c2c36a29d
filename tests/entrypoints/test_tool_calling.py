"""Tool calling through the server with the official openai client, on the default model (whose chat
template knows nothing of tools, so the fallback prompt lists them): a round trip (tools -> tool_calls
-> tool message -> answer) streamed and not, `required` and named choices enforced (arguments valid
against the schema by jsonschema), parallel_tool_calls false, streamed deltas joined equal to the plain
reply, /v1/responses function calls, bad input as 400s; and a server with --chat-template,
--reasoning-parser qwen3 and --tool-call-parser llama3_json: reasoning split streamed and not,
chat_template_kwargs, a template that renders tools itself, llama3_json calls after reasoning."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import ServerProcess, start_server

pytestmark = pytest.mark.server

MODEL = "SmolLM2-135M-Instruct"
# no prefix cache: a bf16 prefill over a cached prefix rounds differently, and a seeded temperature-1
# reply compared streamed and not would hinge on it
ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--no-prefix-caching"]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a city", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory) -> Iterator[ServerProcess]:
    process = start_server(ARGS, tmp_path_factory.mktemp("tools") / "server.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(default_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_server.base_url}/v1", api_key="x", max_retries=0, timeout=600)


def check_calls(calls, names=SCHEMAS) -> None:
    """Each call has an id, a known name and arguments valid against that function's schema."""
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client, **kwargs) -> dict:
    """A streamed reply joined as a client joins it: content, reasoning, calls by index, finish."""
    content, reasoning, calls, finish = [], [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        (choice,) = chunk.choices
        delta = choice.delta
        content.append(delta.content or "")
        reasoning.append((delta.model_extra or {}).get("reasoning") or "")
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in calls and call.function.name, "a call's id and name come first"
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return {
        "content": "".join(content) or None,
        "reasoning": "".join(reasoning) or None,
        "calls": [calls[index] for index in sorted(calls)],
        "finish": finish,
    }


def plain(client, **kwargs) -> dict:
    (choice,) = client.chat.completions.create(**kwargs).choices
    message = choice.message
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]
    reasoning = (message.model_extra or {}).get("reasoning")
    return {
        "content": message.content or None,
        "reasoning": reasoning,
        "calls": calls,
        "finish": choice.finish_reason,
    }


def prompt_text(client, extra_body=None, **kwargs) -> str:
    """The prompt the server rendered, from its prompt logprobs' decoded tokens."""
    extra_body = {**(extra_body or {}), "prompt_logprobs": 0}
    response = client.chat.completions.create(max_tokens=1, extra_body=extra_body, **kwargs)
    entries = response.model_extra["prompt_logprobs"][1:]
    return "".join(next(iter(entry.values()))["decoded_token"] for entry in entries)


@pytest.mark.slow
def test_the_fallback_prompt_lists_the_tools(client):
    text = prompt_text(client, model=MODEL, messages=QUESTION, tools=TOOLS)
    assert "<tools>" in text and json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert "<tool_call>" in text and "What is the weather like in Paris" in text
    none = prompt_text(client, model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none")
    assert "<tools>" not in none and "get_weather" not in none


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_round_trip(client, stream):
    ask = streamed if stream else plain
    first = ask(
        client, model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=120, seed=3
    )
    assert first["finish"] == "tool_calls" and first["calls"]
    for call in first["calls"]:
        assert call["name"] in SCHEMAS
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in first["calls"]
            ],
        },
        *({"role": "tool", "tool_call_id": c["id"], "content": "Sunny, 23 degrees."} for c in first["calls"]),
    ]
    rendered = prompt_text(client, model=MODEL, messages=history, tools=TOOLS)
    assert "<tool_response>\nSunny, 23 degrees.\n</tool_response>" in rendered
    assert f'"arguments": {first["calls"][0]["arguments"]}' in rendered
    answer = ask(
        client, model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40, seed=3
    )
    assert answer["content"] and not answer["calls"] and answer["finish"] in ("stop", "length")


@pytest.mark.slow
def test_required_and_named_are_enforced(client):
    """Every call the grammar let through is whole and valid (a tiny model may go on calling until
    max_tokens cuts it, leaving the cut call's text as content)."""
    for seed in range(6):
        kwargs = {"model": MODEL, "tools": TOOLS, "max_tokens": 160, "temperature": 1.0, "seed": seed}
        required = client.chat.completions.create(messages=QUESTION, tool_choice="required", **kwargs)
        (choice,) = required.choices
        check_calls(choice.message.tool_calls)
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None
        else:
            assert choice.finish_reason == "length"
            assert (choice.message.content or "<").lstrip().startswith("<")  # the cut call, if any
        named = client.chat.completions.create(
            messages=[{"role": "user", "content": "Tell me a joke."}],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            **kwargs,
        )
        check_calls(named.choices[0].message.tool_calls, names={"get_time"})


@pytest.mark.slow
def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in range(4):
        response = client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=160,
            temperature=1.0,
            seed=seed,
        )
        (choice,) = response.choices
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls" and choice.message.content is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "choice", ["required", "auto", {"type": "function", "function": {"name": "get_weather"}}], ids=str
)
def test_streamed_deltas_join_to_the_plain_reply(client, choice):
    """One call at most, so that the grammar ends the reply: a call cut by max_tokens stays a call in a
    stream (its name streamed) but is content in the plain reply (docs/server.md, "Tool calling")."""
    for seed in (1, 2):
        kwargs = {
            "parallel_tool_calls": False,
            "model": MODEL,
            "messages": QUESTION,
            "tools": TOOLS,
            "tool_choice": choice,
            "max_tokens": 120,
            "temperature": 1.0,
            "seed": seed,
        }
        one, other = plain(client, **kwargs), streamed(client, **kwargs)
        for reply in (one, other):
            for call in reply["calls"]:
                call.pop("id")
        assert one == other


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_calls(client, stream):
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    kwargs = {
        "model": MODEL,
        "input": "Weather in Paris?",
        "tools": tools,
        "tool_choice": "required",
        "parallel_tool_calls": False,  # one call, then the grammar ends the reply
    }
    if stream:
        events = list(client.responses.create(stream=True, max_output_tokens=120, **kwargs))
        kinds = [event.type for event in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
        response = events[-1].response
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert deltas == "".join(e.arguments for e in done)
    else:
        response = client.responses.create(max_output_tokens=120, **kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and response.status == "completed"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    answer = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            *(
                {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                for c in calls
            ),
            *({"type": "function_call_output", "call_id": c.call_id, "output": "Sunny."} for c in calls),
        ],
        tools=tools,
        tool_choice="none",
        max_output_tokens=20,
    )
    assert answer.output_text and not [item for item in answer.output if item.type == "function_call"]


def bad(**fields) -> dict:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": 2, **fields}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            bad(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
            "nope",
        ),
        (bad(tools={"type": "function"}), "tools", "list"),
        (bad(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools", "name"),
        (bad(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools", "pattern"),
        (bad(tools=[TOOLS[0], TOOLS[0]]), "tools", "two functions"),
        (bad(tool_choice="required"), "tool_choice", "needs tools"),
        (bad(tool_choice="auto"), "tool_choice", "needs tools"),
        (bad(tools=TOOLS, tool_choice="sometimes"), "tool_choice", ""),
        (
            bad(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
            "tool_choice",
            "response_format",
        ),
        (
            bad(
                tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"not": {"type": "string"}}}}
                ],
                tool_choice="required",
            ),
            "tools",
            "not",
        ),
        (bad(chat_template_kwargs={"tools": []}), "chat_template_kwargs", "tools"),
        (
            bad(
                messages=[
                    {"role": "user", "content": "x", "tool_calls": []},
                    {"role": "user", "content": "y"},
                ]
            ),
            "messages",
            "",
        ),
        (
            bad(messages=[{"role": "user", "content": "x", "tool_call_id": "call_1"}]),
            "messages",
            "tool_call_id",
        ),
    ],
)
def test_bad_tool_input_is_400(default_server, body, param, words):
    with default_server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert words in error["message"]


THINKING_TEMPLATE = (  # reads tools, so they and the tool turns are its to render
    "{% if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}CALLS {{ m.tool_calls | tojson }}{% endif %}"
    "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
THOUGHT = {"regex": "[a-z ]{3,30}</think>[A-Z][a-z ]{3,30}"}  # forces a split in the tiny model's reply


@pytest.fixture(scope="module")
def thinking_client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    folder = tmp_path_factory.mktemp("thinking")
    (folder / "template.jinja").write_text(THINKING_TEMPLATE)
    args = [*ARGS, "--chat-template", str(folder / "template.jinja"), "--reasoning-parser", "qwen3"]
    args += ["--tool-call-parser", "llama3_json"]
    process = start_server(args, folder / "server.log")
    yield openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="x", max_retries=0, timeout=600)
    process.stop()


@pytest.mark.slow
def test_reasoning_is_split_streamed_and_not(thinking_client):
    kwargs = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 60,
        "temperature": 1.0,
        "extra_body": {"structured_outputs": THOUGHT},
    }
    for seed in (1, 2):
        one = plain(thinking_client, seed=seed, **kwargs)
        other = streamed(thinking_client, seed=seed, **kwargs)
        assert one == other
        assert one["reasoning"] and "</think>" not in one["reasoning"] + one["content"]
        assert one["content"][0].isupper()
    off = plain(
        thinking_client,
        seed=1,
        **{**kwargs, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
    )
    assert off["reasoning"] is None and off["content"]


@pytest.mark.slow
def test_chat_template_override_renders_the_prompt(thinking_client):
    text = prompt_text(thinking_client, model=MODEL, messages=QUESTION)
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    off = prompt_text(
        thinking_client,
        model=MODEL,
        messages=QUESTION,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.endswith("<think>\n\n</think>\n\n")


@pytest.mark.slow
def test_a_template_that_reads_tools_renders_them(thinking_client):
    call = {
        "id": "call_7",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'},
    }
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": "noon"},
    ]
    text = prompt_text(thinking_client, model=MODEL, messages=history, tools=TOOLS)
    assert "TOOLS [" in text and '"name": "get_weather"' in text and "You may call" not in text
    assert '"arguments": {"city": "Oslo"}' in text  # as an object, as templates index them
    assert "<|im_start|>tool\nnoon FOR call_7<|im_end|>" in text


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_responses_reasoning_item(thinking_client, stream):
    kwargs = {
        "model": MODEL,
        "input": "Weather in Paris?",
        "max_output_tokens": 60,
        "temperature": 1.0,
        "extra_body": {"text": {"format": {"type": "text"}}},
    }
    # the Responses API has no structured_outputs field: a regex cannot force the split here, so the
    # reply is reasoning until </think> or its end (the prompt opens <think>)
    if stream:
        events = list(thinking_client.responses.create(stream=True, **kwargs))
        response = events[-1].response
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
        assert deltas == done.text
    else:
        response = thinking_client.responses.create(**kwargs)
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    assert "</think>" not in reasoning.content[0].text
    if stream:
        assert reasoning.content[0].text == deltas
    # the tokens through </think>: fewer than all exactly when some text came after it
    usage = response.usage
    content = "".join(
        part.text for item in response.output if item.type == "message" for part in item.content
    )
    assert 0 < usage.output_tokens_details.reasoning_tokens <= usage.output_tokens
    assert (usage.output_tokens_details.reasoning_tokens < usage.output_tokens) == bool(content)


@pytest.mark.slow
def test_llama3_json_calls_after_the_reasoning_parser(thinking_client):
    """The enforced call is the content (the reasoning parser steps aside under required), which the
    llama3_json parser reads; streamed and plain replies agree."""
    for seed in (1, 2):
        kwargs = {
            "model": MODEL,
            "messages": QUESTION,
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 120,
            "temperature": 1.0,
            "seed": seed,
            # thinking on or off: the grammar makes the reply the call, which no reasoning swallows
            "extra_body": {"chat_template_kwargs": {"enable_thinking": seed == 1}},
        }
        one, other = plain(thinking_client, **kwargs), streamed(thinking_client, **kwargs)
        assert one["finish"] == "tool_calls" and one["reasoning"] is None and one["content"] is None
        (call,) = one["calls"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        for reply in (one, other):
            reply["calls"][0].pop("id")
        assert one == other
