"""A request's tools, checked and resolved once (chat and responses alike), and the per-choice parser
that splits generated text into reasoning, content and tool calls (docs/server.md, "Tool calling")."""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass
from typing import Any

from llmserve.entrypoints.openai.chat_options import ChatOptions
from llmserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from llmserve.entrypoints.openai.serving import ApiError
from llmserve.entrypoints.openai.tool_grammar import tool_call_grammar
from llmserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedDelta, ToolCall, ToolParser
from llmserve.structured.params import GrammarError, StructuredOutputsParams


@dataclass(frozen=True)
class ToolSpec:
    """Tools in force for a request (tool_choice not "none"): chat-format tool dicts for templates."""

    tools: tuple[dict[str, Any], ...]
    choice: str  # "auto", "required" or "named"
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def enforced(self) -> bool:
        return self.choice != "auto"

    @property
    def hint(self) -> str | None:
        """What the fallback prompt says must be called: "required", a function's name, or nothing."""
        return {"auto": None, "required": "required"}.get(self.choice, self.name)

    def functions(self) -> list[tuple[str, dict[str, Any] | None]]:
        """(name, parameters) of the functions the output may call."""
        pairs = [(tool["function"]["name"], tool["function"].get("parameters")) for tool in self.tools]
        return [pair for pair in pairs if self.name is None or pair[0] == self.name]


def resolve_tools(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool) -> ToolSpec | None:
    """The request's ToolSpec, None when no tools are in force; 400s for inconsistent fields.
    `tools` are chat-format dicts; `choice` is a string or a named function's name as {"name": ...}."""
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(
                "tool_choice needs tools: set tools, or leave tool_choice out", param="tool_choice"
            )
        return None
    names = [tool["function"]["name"] for tool in tools]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise ApiError(f"tools: two functions are named {duplicate!r}", param="tools")
    if choice == "none":
        return None
    if isinstance(choice, dict):
        if choice["name"] not in names:
            raise ApiError(
                f"tool_choice names the function {choice['name']!r}, which is not in tools "
                f"({', '.join(names)})",
                param="tool_choice",
            )
        return ToolSpec(tuple(tools), "named", choice["name"], parallel)
    return ToolSpec(tuple(tools), choice or "auto", None, parallel)


async def enforced_grammar(
    spec: ToolSpec | None, parser: str, timeout: float
) -> StructuredOutputsParams | None:
    """The grammar that makes `required` and named tool choices hold (None for auto or no tools);
    built in a thread (a large schema takes a while), a 400 for a schema it cannot enforce."""
    if spec is None or not spec.enforced:
        return None
    try:
        key = json.dumps(spec.functions(), sort_keys=True)
        grammar = await asyncio.wait_for(asyncio.to_thread(_grammar, key, parser, spec.parallel), timeout)
    except GrammarError as error:
        raise ApiError(f"tools: {error}", param="tools") from error
    except TimeoutError as error:
        raise ApiError(
            f"tools: the parameters schemas did not convert within {timeout:g} s; simplify them",
            param="tools",
        ) from error
    return StructuredOutputsParams(grammar=grammar)


@functools.lru_cache(maxsize=64)
def _grammar(functions: str, parser: str, parallel: bool) -> str:
    """tool_call_grammar of the functions' JSON, cached: a tool set comes back request after request."""
    return tool_call_grammar([tuple(pair) for pair in json.loads(functions)], parser, parallel)


@dataclass
class ParsedChoice:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class ChoiceDelta:
    reasoning: str
    parsed: ParsedDelta


class OutputParser:
    """One choice's text through the reasoning parser, then the tool-call parser on its content.
    Without parallel tool calls, calls after the first are dropped."""

    def __init__(self, spec: ToolSpec | None, options: ChatOptions, prompt_text: str) -> None:
        self.reasoning: ReasoningParser | None = None
        # under required or named choices the grammar makes the output the calls alone: no reasoning
        if options.reasoning_parser is not None and (spec is None or not spec.enforced):
            self.reasoning = REASONING_PARSERS[options.reasoning_parser](prompt_text)
        self.tools: ToolParser | None = None if spec is None else TOOL_PARSERS[options.tool_call_parser]()
        self.max_calls = None if spec is None or spec.parallel else 1
        self.called = False

    def feed(self, delta: str) -> ChoiceDelta:
        return self._split(self.reasoning.feed(delta) if self.reasoning else None, delta, final=False)

    def finish(self) -> ChoiceDelta:
        return self._split(self.reasoning.finish() if self.reasoning else None, "", final=True)

    def step(self, text: str, finished: bool) -> ChoiceDelta:
        """A stream's delta of text; `finished`: the choice ended with it, so everything held is let go."""
        piece = self.feed(text) if text else ChoiceDelta("", ParsedDelta())
        if finished:
            final = self.finish()
            piece.reasoning += final.reasoning
            piece.parsed.add(final.parsed)
        return piece

    def parse(self, text: str) -> ParsedChoice:
        """The whole text at once (as one final delta)."""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse(text)
        else:
            reasoning, content = None, text
        if self.tools is None:
            return ParsedChoice(reasoning, content, [])
        parsed = self.tools.parse(content)
        calls = parsed.tool_calls[: self.max_calls]
        return ParsedChoice(reasoning, parsed.content, calls)

    def _split(self, split: Any, delta: str, final: bool) -> ChoiceDelta:
        reasoning, content = (split.reasoning, split.content) if split is not None else ("", delta)
        if self.tools is None:
            return ChoiceDelta(reasoning, ParsedDelta(content=content))
        parsed = self.tools.feed(content) if content else ParsedDelta()
        if final:
            parsed.add(self.tools.finish())
        if self.max_calls is not None:
            parsed.tool_calls = [call for call in parsed.tool_calls if call.index < self.max_calls]
        self.called = self.called or bool(parsed.tool_calls)
        return ChoiceDelta(reasoning, parsed)


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's: a reply that ended by itself after calling tools finished for `tool_calls`."""
    return "tool_calls" if called and reason == "stop" else reason
