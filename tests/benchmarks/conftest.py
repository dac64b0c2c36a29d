"""Fixtures for the benchmark tests: a tokenizer-free byte tokenizer and a tiny random Llama."""

from __future__ import annotations

from collections.abc import Sequence

import pytest


class ByteTokenizer:
    """One token per UTF-8 byte: exact lengths without loading a model."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(token_ids).decode(errors="replace")


@pytest.fixture(scope="session")
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama with the real tokenizer (peaked logits: greedy has no near-ties)."""
    from tests.helpers import make_tiny_llama_dir

    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny-llama")))
