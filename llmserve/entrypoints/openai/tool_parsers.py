"""Tool calls parsed out of generated text, incrementally: the same parser serves a stream (fed each
delta) and a plain response (fed the whole text once), so the streamed pieces join to the plain result.

Two formats, under vLLM's `--tool-call-parser` names:
- `hermes` (Hermes, Qwen): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
  number of them, with text around them as content; a block may also hold a JSON list of calls.
- `llama3_json` (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}`, several joined
  by `;`, optionally after `<|python_tag|>`; output that does not start with `{` is content.

A call streams as its header (index, id, name) once the name is complete, then its arguments' raw JSON
text as it grows, so a call's `arguments` is the text the model wrote for them (compact JSON when the
grammar enforced it). A call whose JSON is malformed is left as content (when nothing of it streamed
yet); text held back (a possible start of a tag, whitespace before a call) is flushed by `finish`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

_NAME_THEN_ARGS = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass
class ToolCallDelta:
    """A piece of one call: the header (id and name) once, then fragments of its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class JsonScanner:
    """Where the JSON object or array opening at `start` ends, reading only the text added since the
    last `scan` (a stream's deltas cost their own length, not the whole call's each time)."""

    def __init__(self, start: int) -> None:
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        """The index just past the value's end, or None while it is not closed."""
        if self.end is not None:
            return self.end
        for index in range(self.pos, len(text)):
            char = text[index]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = index + 1
                    return self.end
        self.pos = len(text)
        return None


def json_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array opening at text[start], or None if not closed yet."""
    return JsonScanner(start).scan(text)


class _Call:
    """One call's JSON text as it grows: emits the header when the name is complete and the arguments'
    raw text as it arrives (only for the usual `{"name": ..., "arguments": {...}}` key order)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_call_id()
        self.header_sent = False
        self.args_sent = 0  # characters of the raw arguments text sent so far
        self.done = False
        self.name = ""
        self.scanner: JsonScanner | None = None  # the arguments' end, once the name is known
        self.scanner_start = 0  # where the arguments start in the body
        self.outer: JsonScanner | None = None  # llama3_json: the end of the call's own object

    def progress(self, body: str) -> list[ToolCallDelta]:
        """What `body` (the call's JSON so far, growing by appends) adds to the call."""
        if self.scanner is None:
            match = _NAME_THEN_ARGS.match(body)
            if match is None:
                return []
            self.name = json.loads(f'"{match.group(1)}"')
            self.scanner, self.scanner_start = JsonScanner(match.end()), match.end()
        start = self.scanner_start
        end = self.scanner.scan(body)
        if end is None:  # trailing whitespace may be the end of the arguments: it waits
            end = len(body)
            while end > start and body[end - 1] in " \t\r\n":
                end -= 1
        out = self._header(self.name)
        piece = body[start + self.args_sent : end]
        self.args_sent = end - start
        return out + ([ToolCallDelta(self.index, arguments=piece)] if piece else [])

    def complete(self, body: str) -> list[ToolCallDelta] | None:
        """The rest of the call, its JSON now whole; None when it is not a valid call."""
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not _is_call(value):
            return None
        self.done = True
        match = _NAME_THEN_ARGS.match(body)
        end = json_end(body, match.end()) if match else None
        # the arguments as written when they may have streamed so, else as JSON of the parsed value
        raw = body[match.end() : end] if match and end is not None else _arguments_text(value)
        return self._header(value["name"]) + self._args(raw)

    def _header(self, name: str) -> list[ToolCallDelta]:
        if self.header_sent:
            return []
        self.header_sent = True
        return [ToolCallDelta(self.index, id=self.id, name=name)]

    def _args(self, raw: str) -> list[ToolCallDelta]:
        piece = raw[self.args_sent :]
        self.args_sent = len(raw)
        return [ToolCallDelta(self.index, arguments=piece)] if piece else []


def _is_call(value: object) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("name"), str)
        and isinstance(value.get("arguments", value.get("parameters", {})), dict | str)
    )


def _arguments_text(value: dict) -> str:
    """The arguments as JSON text (a string holding JSON, as some models write them, as it is)."""
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
            return arguments
        except ValueError:
            pass
    return json.dumps(arguments, ensure_ascii=False)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag` (held back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ToolParser:
    """Feed deltas, then `finish`; each returns what became certain. `parse` does it in one go."""

    name = ""

    def __init__(self) -> None:
        self.text = ""  # everything fed
        self.pos = 0  # text before it is emitted (as content) or part of a finished call
        self.calls: list[_Call] = []
        self.held_space = ""  # whitespace content held until more content follows

    def feed(self, delta: str) -> ParsedDelta:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> ParsedDelta:
        out = self._advance(final=True)
        if not self.calls:
            out.content += self.held_space
        self.held_space = ""
        return out

    def parse(self, text: str) -> ParsedOutput:
        """The whole output's content (None when only whitespace is around calls) and calls. As one
        final delta: a call cut off or malformed is content here, though a stream sent its name."""
        self.text += text
        out = self.finish()
        calls: dict[int, ToolCall] = {}
        for delta in out.tool_calls:
            call = calls.setdefault(delta.index, ToolCall(delta.id or "", delta.name or "", ""))
            call.arguments += delta.arguments
        content = out.content if out.content or not calls else None
        return ParsedOutput(content, list(calls.values()))

    def _content(self, text: str) -> str:
        """Content to emit now: whitespace waits for content after it (dropped if only calls follow)."""
        if not text.strip():
            self.held_space += text
            return ""
        lead, self.held_space = self.held_space, ""
        stripped = text.rstrip()
        self.held_space = text[len(stripped) :]
        return lead + stripped

    def _advance(self, final: bool) -> ParsedDelta:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.body_start: int | None = None  # inside a block: where its JSON starts

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self.body_start is None:
                start = self.text.find(self.START, self.pos)
                if start == -1:
                    keep = 0 if final else _held_prefix(self.text[self.pos :], self.START)
                    out.content += self._content(self.text[self.pos : len(self.text) - keep])
                    self.pos = len(self.text) - keep
                    return out
                out.content += self._content(self.text[self.pos : start])
                self.pos = start
                self.body_start = start + len(self.START)
                self.calls.append(_Call(len(self.calls)))
                continue
            end = self.text.find(self.END, self.body_start)
            if end == -1 and not final:
                body = self.text[self.body_start :]
                if not body.lstrip().startswith("["):
                    out.tool_calls += self.calls[-1].progress(body)
                return out
            stop = len(self.text) if end == -1 else end
            out.add(
                self._close(self.text[self.body_start : stop], self.text[self.pos : stop + len(self.END)])
            )
            self.pos = min(len(self.text), stop + len(self.END))
            self.body_start = None
            if end == -1:
                return out

    def _close(self, body: str, block: str) -> ParsedDelta:
        """A whole block: its call (or list of calls), or its text as content when not valid."""
        call = self.calls[-1]
        deltas = call.complete(body)
        if deltas is not None:
            return ParsedDelta(tool_calls=deltas)
        if not call.header_sent:
            listed = _call_list(body)
            if listed is not None:
                self.calls.pop()
                return ParsedDelta(tool_calls=self._listed(listed))
            self.calls.pop()
            return ParsedDelta(content=self._content(block))
        return ParsedDelta()  # its name already streamed: what streamed stands

    def _listed(self, values: list[dict]) -> list[ToolCallDelta]:
        deltas = []
        for value in values:
            call = _Call(len(self.calls))
            self.calls.append(call)
            deltas += call._header(value["name"]) + call._args(_arguments_text(value))
        return deltas


def _call_list(body: str) -> list[dict] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if isinstance(value, list) and value and all(_is_call(item) for item in value):
        return value
    return None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.mode: str | None = None  # "calls" or "content", decided by the first non-space text

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        if self.mode is None:
            head = self.text.lstrip()
            if head.startswith(self.PYTHON_TAG):
                self.mode, self.pos = "calls", self.text.index(self.PYTHON_TAG) + len(self.PYTHON_TAG)
            elif head.startswith("{"):
                self.mode = "calls"
            elif head and not self.PYTHON_TAG.startswith(head) or final:
                self.mode = "content"
            else:
                return out
        if self.mode == "content":
            out.content += self._content(self.text[self.pos :])
            self.pos = len(self.text)
            return out
        while True:
            rest = self.text[self.pos :]
            start = len(rest) - len(rest.lstrip(" \t\r\n;"))
            if start == len(rest) or rest[start] != "{":
                if start < len(rest):  # not a call: the rest is content
                    self.mode = "content"
                    return self._advance(final) if not self.calls else self._rest_as_content(out)
                return out
            if not self.calls or self.calls[-1].done:
                self.calls.append(_Call(len(self.calls)))
                self.calls[-1].outer = JsonScanner(start)  # `rest` only grows until the call is done
            end = self.calls[-1].outer.scan(rest)
            if end is None and not final:
                out.tool_calls += self.calls[-1].progress(rest[start:])
                return out
            body = rest[start:end] if end is not None else rest[start:]
            deltas = self.calls[-1].complete(body)
            if deltas is None:
                if not self.calls[-1].header_sent:
                    self.calls.pop()
                    self.mode = "content"
                    return self._rest_as_content(out)
                deltas = []
            out.tool_calls += deltas
            self.calls[-1].done = True
            self.pos += end if end is not None else len(rest)
            if end is None:
                return out

    def _rest_as_content(self, out: ParsedDelta) -> ParsedDelta:
        out.content += self._content(self.text[self.pos :])
        self.pos = len(self.text)
        return out


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}
