"""Structured outputs' settings (llmserve/structured, docs/server.md "Structured outputs")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputsConfig:
    compile_timeout: float = 10.0  # seconds a grammar may take to compile; longer is a 400

    def __post_init__(self) -> None:
        if not self.compile_timeout > 0:
            raise ValueError(f"structured_outputs_compile_timeout must be > 0, got {self.compile_timeout}")
