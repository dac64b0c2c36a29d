"""Tool-call and reasoning parsers on hand-written model outputs: calls, content and reasoning as a plain
response gets them, and the same joined from a stream fed in random pieces."""

from __future__ import annotations

import json
import random

import pytest

from llmserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, count_reasoning_tokens
from llmserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedDelta, json_end
from llmserve.entrypoints.openai.tool_prompt import format_calls, rewrite_for_plain_template

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"a": "}]"}]}}'

CASES = [
    # (parser, text, content, [(name, arguments)])
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", WEATHER[37:-1])]),
    (
        "hermes",
        'Let me look. <tool_call>{"name": "a", "arguments": {"x":1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>\n',
        "Let me look.",
        [("a", '{"x":1}'), ("b", "{}")],
    ),
    ("hermes", "no call, <tool_ but a stray tag\n", "no call, <tool_ but a stray tag\n", []),
    (  # malformed JSON stays content
        "hermes",
        '<tool_call>{"name": "a", "arguments": {x: 1}}</tool_call> then text',
        '<tool_call>{"name": "a", "arguments": {x: 1}}</tool_call> then text',
        [],
    ),
    (  # keys in the other order: the arguments re-serialized
        "hermes",
        '<tool_call>{"arguments": {"x":1}, "name": "a"}</tool_call>',
        None,
        [("a", '{"x": 1}')],
    ),
    (  # a list of calls in one block, as some models write them
        "hermes",
        '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>',
        None,
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    (  # a block left open at the end is still a call when its JSON is whole
        "hermes",
        '<tool_call>{"name": "a", "arguments": {"x": 1}}',
        None,
        [("a", '{"x": 1}')],
    ),
    (
        "llama3_json",
        '{"name": "a", "parameters": {"q": "x; y"}}; {"name": "b", "parameters": {}}',
        None,
        [("a", '{"q": "x; y"}'), ("b", "{}")],
    ),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}', None, [("a", "{}")]),
    ("llama3_json", 'Sure: {"name": "a", "parameters": {}}', 'Sure: {"name": "a", "parameters": {}}', []),
    ("llama3_json", '{"name": "a", "parameters": {x}}', '{"name": "a", "parameters": {x}}', []),
    ("llama3_json", "{not json at all", "{not json at all", []),
]


def joined(parser, text: str, seed: int) -> tuple[str | None, list[tuple[str, str]], set[str]]:
    """A stream's pieces fed in random sizes, joined as a client does."""
    rng = random.Random(seed)
    out, start = ParsedDelta(), 0
    while start < len(text):
        size = rng.randint(1, 6)
        out.add(parser.feed(text[start : start + size]))
        start += size
    out.add(parser.finish())
    calls: dict[int, list[str]] = {}
    ids = set()
    for delta in out.tool_calls:
        if delta.id is not None:
            assert delta.index not in calls, "a call's header comes once, first"
            calls[delta.index] = [delta.name, ""]
            ids.add(delta.id)
        calls[delta.index][1] += delta.arguments
    return out.content or None, [tuple(call) for call in calls.values()], ids


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_parse(name, text, content, calls):
    parsed = TOOL_PARSERS[name]().parse(text)
    assert parsed.content == content
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == calls
    for call in parsed.tool_calls:
        assert call.id.startswith("call_")
        json.loads(call.arguments)


# a call whose JSON breaks after its name streamed stays a call in the stream (the next test)
WELL_FORMED = [case for case in CASES if "x: 1" not in case[1] and "{x}" not in case[1]]


@pytest.mark.parametrize(("name", "text", "content", "calls"), WELL_FORMED)
def test_streamed_pieces_join_to_the_plain_result(name, text, content, calls):
    for seed in range(100):
        got_content, got_calls, ids = joined(TOOL_PARSERS[name](), text, seed)
        assert (got_content, got_calls) == (content, calls), seed
        assert len(ids) == len(calls)


def test_a_call_broken_after_its_name_streamed():
    parser = TOOL_PARSERS["hermes"]()
    head = parser.feed('<tool_call>{"name": "a", "arguments": {"x"')
    assert [(d.index, d.name) for d in head.tool_calls if d.id] == [(0, "a")]
    rest = parser.feed(": oops}}</tool_call> more")
    rest.add(parser.finish())
    assert rest.content == " more"  # the broken call's text is not repeated as content


def test_arguments_stream_before_the_call_ends():
    parser = TOOL_PARSERS["hermes"]()
    first = parser.feed('Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert first.content == "Hi"
    header, fragment = first.tool_calls
    assert header.name == "get_weather" and header.arguments == ""
    assert fragment.id is None and fragment.arguments == '{"city": "Pa'
    assert parser.feed("ris").tool_calls[0].arguments == "ris"
    end = parser.feed('"}}\n</tool_call>')
    assert [d.arguments for d in end.tool_calls] == ['"}']


def test_content_is_not_held_back_longer_than_a_possible_tag():
    parser = TOOL_PARSERS["hermes"]()
    assert parser.feed("Hello <tool").content == "Hello"
    assert parser.feed("box> ok").content == " <toolbox> ok"


def test_json_end_skips_braces_in_strings():
    text = '{"a": "}{", "b": [1, {"c": "\\"}"}]} tail'
    assert text[: json_end(text, 0)] == text[: -len(" tail")]
    assert json_end('{"a": [1, 2', 0) is None


REASONING = [
    # (parser, prompt tail, text, reasoning, content)
    ("qwen3", "", "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "\n\nParis."),
    ("qwen3", "", "Paris, no thinking.", None, "Paris, no thinking."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Hmm.</think>Paris.", "Hmm.", "Paris."),
    ("qwen3", "", "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    ("qwen3", "", "<thin", None, "<thin"),
    ("deepseek_r1", "", "Thinking</think>Answer", "Thinking", "Answer"),
    ("deepseek_r1", "", "<think>Thinking</think>Answer", "Thinking", "Answer"),
    ("deepseek_r1", "", "all reasoning", "all reasoning", ""),
]


@pytest.mark.parametrize(("name", "prompt", "text", "reasoning", "content"), REASONING)
def test_reasoning_parsers(name, prompt, text, reasoning, content):
    assert REASONING_PARSERS[name](prompt).parse(text) == (reasoning, content)
    for seed in range(50):
        rng, parser, start = random.Random(seed), REASONING_PARSERS[name](prompt), 0
        pieces = []
        while start < len(text):
            size = rng.randint(1, 4)
            pieces.append(parser.feed(text[start : start + size]))
            start += size
        pieces.append(parser.finish())
        got = "".join(p.reasoning for p in pieces), "".join(p.content for p in pieces)
        assert got == (reasoning or "", content), seed


@pytest.mark.parametrize(
    ("name", "prompt", "pieces", "reasoning_pieces"),
    [
        ("qwen3", "", ["<think>Let me see.", "</think>", "Paris."], 2),
        ("qwen3", "<|im_start|>assistant\n<think>\n", ["Hmm, rain", "</think>", "Paris."], 2),
        ("qwen3", "", ["Paris, no thinking.", "</think>", "Or is it?"], 0),  # not opened: no reasoning
        ("deepseek_r1", "", ["Thinking hard", "</think>", "Answer"], 2),
        ("deepseek_r1", "", ["all of it is reasoning, cut off"], 1),
    ],
)
def test_reasoning_tokens_are_the_output_tokens_through_the_end_tag(name, prompt, pieces, reasoning_pieces):
    """Pieces tokenized one by one: the reasoning's tokens are exactly those of its pieces (the tag's
    included), however the decoded text splits."""
    from llmserve.model_loader import default_model_path, load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    encoded = [tokenizer.encode(piece, add_special_tokens=False) for piece in pieces]
    token_ids = [token for ids in encoded for token in ids]
    parser = REASONING_PARSERS[name](prompt)
    parser.parse(tokenizer.decode(token_ids))

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    expected = sum(len(ids) for ids in encoded[:reasoning_pieces])
    assert count_reasoning_tokens(token_ids, decode, parser) == expected
    assert count_reasoning_tokens(token_ids, decode, None) == 0  # no parser: no reasoning


def test_fallback_rewrites_tool_turns_in_the_parsers_format():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "tool", "content": "43", "tool_call_id": "call_2"},
    ]
    out = rewrite_for_plain_template(messages, "hermes", "TOOLS")
    assert out == [
        {"role": "system", "content": "Be brief.\n\nTOOLS"},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'},
        {
            "role": "user",
            "content": "<tool_response>\n42\n</tool_response>\n<tool_response>\n43\n</tool_response>",
        },
    ]
    # what the fallback writes for a call, the parser reads back
    for name in TOOL_PARSERS:
        parsed = TOOL_PARSERS[name]().parse(format_calls(calls * 2, name))
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("f", {"x": 1})] * 2


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def accepts(grammar: str, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(grammar, text)


def test_required_grammar_accepts_only_calls_valid_against_their_schemas():
    from llmserve.entrypoints.openai.tool_grammar import tool_call_grammar

    grammar = tool_call_grammar([("get_weather", CITY), ("get_time", None)], "hermes", parallel=True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(grammar, call) and accepts(grammar, f"{call}\n{other}")
    assert not accepts(grammar, "")  # at least one call
    assert not accepts(grammar, "Sure. " + call)  # nothing but calls
    assert not accepts(grammar, call.replace('"Paris"}', '"Paris", "extra": 1}'))  # strict schema
    assert not accepts(grammar, call.replace('{"city": "Paris"}', "{}"))  # a required property
    assert not accepts(grammar, call.replace("get_weather", "get_news"))  # only listed functions
    single = tool_call_grammar([("get_weather", CITY)], "llama3_json", parallel=False)
    one = '{"name": "get_weather", "parameters": {"city": "P"}}'
    assert accepts(single, one) and not accepts(single, f"{one}; {one}")
    # what the grammar allows, the parser reads back as the same calls
    parsed = TOOL_PARSERS["hermes"]().parse(f"{call}\n{other}")
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]


def test_a_schema_the_grammar_engine_would_ignore_is_refused():
    from llmserve.entrypoints.openai.tool_grammar import tool_call_grammar
    from llmserve.structured.params import GrammarError

    with pytest.raises(GrammarError, match="'f'.*not"):
        tool_call_grammar([("f", {"type": "object", "not": {"required": ["a"]}})], "hermes", parallel=True)
