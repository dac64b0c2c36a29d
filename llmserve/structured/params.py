"""What a request constrains its output to: one of a JSON schema, any JSON object, a regex, a choice of
strings, or an EBNF (GBNF) grammar. Plain data: it crosses the process boundary inside SamplingParams."""

from __future__ import annotations

import json
from dataclasses import dataclass


class GrammarError(ValueError):
    """The grammar is invalid, uses a feature the grammar engine does not support, or took too long."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one field is set; `json` is the schema as canonical JSON text (sorted keys), so equal
    schemas share one compiled grammar."""

    json: str | None = None  # a JSON schema
    json_object: bool = False  # any JSON object (response_format {"type": "json_object"})
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # one of these strings, exactly
    grammar: str | None = None  # EBNF in the GBNF dialect (llama.cpp's), root rule `root`

    def __post_init__(self) -> None:
        chosen = [
            name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, name)
        ]
        if len(chosen) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of json, regex, choice, grammar; got {chosen}"
            )
        if self.choice is not None and not all(isinstance(c, str) for c in self.choice):
            raise ValueError("structured_outputs choice must be a list of strings")

    @classmethod
    def from_schema(cls, schema: dict | str | bool) -> StructuredOutputsParams:
        """A JSON schema given as an object (or its JSON text)."""
        if isinstance(schema, str):
            schema = json.loads(schema)
        return cls(json=json.dumps(schema, sort_keys=True, separators=(",", ":")))

    @property
    def key(self) -> tuple:
        """The compile cache's key."""
        return (self.json, self.json_object, self.regex, self.choice, self.grammar)

    @property
    def kind(self) -> str:
        return next(
            name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, name)
        )
