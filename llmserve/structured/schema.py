"""JSON-schema keywords xgrammar would silently ignore, refused up front: a constraint that is not
enforced must be a 400, not an output that fails the schema."""

from __future__ import annotations

from typing import Any

from llmserve.structured.params import GrammarError

# Applicators xgrammar 0.2 drops without a word (checked against its converter: output violating them
# is accepted). oneOf with overlapping branches is compiled as anyOf, which xgrammar logs.
UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas", "$dynamicRef", "unevaluatedItems")

_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentRequired")


def check_schema(schema: Any, path: str = "#") -> None:
    """Raise GrammarError naming the first unsupported keyword and where it is."""
    if isinstance(schema, list):
        for index, item in enumerate(schema):
            check_schema(item, f"{path}/{index}")
        return
    if not isinstance(schema, dict):
        return
    for keyword in UNSUPPORTED_KEYWORDS:
        if keyword in schema:
            raise GrammarError(f"json schema: the keyword {keyword!r} (at {path}) is not supported")
    for key, value in schema.items():
        if key in _NAMED_SCHEMAS and isinstance(value, dict):  # names there are not keywords
            for name, sub in value.items():
                check_schema(sub, f"{path}/{key}/{name}")
        elif key not in ("enum", "const", "default", "examples"):  # values there are data, not schemas
            check_schema(value, f"{path}/{key}")
