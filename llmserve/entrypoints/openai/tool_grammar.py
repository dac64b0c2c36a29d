"""`tool_choice: "required"` and a named function enforced by the grammar engine: the output must be
one or more calls (exactly one without `parallel_tool_calls`) in the tool-call parser's format, each
naming an allowed function with arguments valid against its parameters schema, then the end.

Built as an xgrammar structural tag (`tags_with_separator`: one tag per function, its arguments a JSON
schema compiled without free whitespace), turned into EBNF text so it travels as any other request
grammar (`StructuredOutputsParams.grammar`) through the compile check, the cache and the engine's mask.
"""

from __future__ import annotations

import json
from typing import Any

from llmserve.structured.params import GrammarError
from llmserve.structured.schema import check_schema

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

# begin of a call before its arguments, end after them, separator between calls
CALL_FORMATS = {
    "hermes": ('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n"),
    "llama3_json": ('{{"name": {name}, "parameters": ', "}", "; "),
}


def tool_call_grammar(functions: list[tuple[str, dict[str, Any] | None]], parser: str, parallel: bool) -> str:
    """EBNF accepting the calls of `functions` ((name, parameters schema) pairs); GrammarError naming
    the function whose schema cannot be enforced."""
    import xgrammar

    begin, end, separator = CALL_FORMATS[parser]
    tags = []
    for name, parameters in functions:
        schema = EMPTY_PARAMETERS if parameters is None else parameters
        try:
            check_schema(schema)
            arguments = xgrammar.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=False, strict_mode=True
            )
        except (GrammarError, RuntimeError, TypeError, ValueError) as error:
            raise GrammarError(f"function {name!r}: parameters: {_first_line(error)}") from error
        tags.append(
            {
                "type": "tag",
                "begin": begin.format(name=json.dumps(name)),
                "content": {"type": "grammar", "grammar": str(arguments)},
                "end": end,
            }
        )
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": separator,
            "at_least_one": True,
            "stop_after_first": not parallel,
        },
    }
    return str(xgrammar.Grammar.from_structural_tag(json.dumps(tag)))


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
