"""Benchmark workloads: prompts cut from real documentation text, with realistic length spreads.

Serving cost depends on how prompt and output lengths vary, not only on their means: padding in a
static batch, KV fragmentation and scheduling all come from the spread. Production traces are
roughly log-normal, so lengths are drawn log-normal (median, sigma) and clipped. Prompts are token
windows of the Python language reference and stdlib docstrings that ship with the interpreter, so
the tokens are real text (realistic vocabulary, realistic tokens per character) on any machine
without a download. Everything is a pure function of the seed.

A workload is a JSONL file, one request a line: `{"prompt": str, "prompt_token_ids": [int],
"max_tokens": int}`. Every request generates exactly `max_tokens` tokens (EOS ignored), so the work
is the same whichever system runs the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from llmserve.corpus import corpus_text
from llmserve.sampling_params import RequestOutputKind, SamplingParams


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_token_ids: list[int]
    max_tokens: int  # generated exactly (ignore_eos)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def to_json(self) -> dict:
        return {
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "max_tokens": self.max_tokens,
        }


def greedy_params(max_tokens: int) -> SamplingParams:
    """Greedy and exactly `max_tokens` (EOS ignored), so every system does the same work."""
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )


@dataclass(frozen=True)
class WorkloadSpec:
    """How to draw a workload. Log-normal lengths unless a fixed length is given."""

    num_requests: int = 100
    seed: int = 0
    prompt_len_median: float = 200.0
    output_len_median: float = 120.0
    sigma: float = 0.6  # of the log of both lengths
    prompt_len_range: tuple[int, int] = (4, 1024)
    output_len_range: tuple[int, int] = (4, 512)
    fixed_prompt_len: int | None = None
    fixed_output_len: int | None = None
    shared_prefixes: int = 0  # K system prompts shared by the requests (0: none)
    prefix_len: int = 500  # tokens of each shared system prompt


class TokenCorpus:
    """The corpus tokenized once; a prompt is the text of a token window at a random offset."""

    def __init__(self, tokenizer: Tokenizer, text: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.token_ids = np.asarray(tokenizer.encode(text or corpus_text()), dtype=np.int64)

    def window_ids(self, rng: np.random.Generator, length: int) -> list[int]:
        """`length` consecutive corpus tokens (wrapping around the end)."""
        start = int(rng.integers(len(self.token_ids)))
        return np.take(self.token_ids, np.arange(start, start + length), mode="wrap").tolist()

    def prompt(self, rng: np.random.Generator, length: int) -> tuple[str, list[int]]:
        """Text of about `length` tokens and its own tokenization (at most `length` tokens).

        Decoding a window and encoding it again can merge or split tokens at the cut; the ids
        returned are the text's, so a server given the text sees the same prompt.
        """
        ids = self.window_ids(rng, length)
        for _ in range(4):
            text = self.tokenizer.decode(ids)
            encoded = self.tokenizer.encode(text)
            if len(encoded) <= length:
                return text, encoded
            ids = ids[: len(ids) - (len(encoded) - length)]
        return text, encoded[:length]


def lognormal_lengths(
    rng: np.random.Generator, count: int, median: float, sigma: float, bounds: tuple[int, int]
) -> np.ndarray:
    """Integer lengths whose log is normal around log(median), clipped to [low, high]."""
    lengths = np.rint(rng.lognormal(np.log(median), sigma, count))
    return np.clip(lengths, *bounds).astype(np.int64)


def build_workload(
    spec: WorkloadSpec, tokenizer: Tokenizer, corpus: TokenCorpus | None = None
) -> list[BenchRequest]:
    """The requests of `spec`, identical for the same seed, tokenizer and Python version."""
    corpus = corpus or TokenCorpus(tokenizer)
    rng = np.random.default_rng(spec.seed)
    prompt_lens = _lengths(rng, spec, spec.fixed_prompt_len, spec.prompt_len_median, spec.prompt_len_range)
    output_lens = _lengths(rng, spec, spec.fixed_output_len, spec.output_len_median, spec.output_len_range)
    if spec.shared_prefixes:
        return _shared_prefix_requests(rng, spec, corpus, prompt_lens, output_lens)
    requests = []
    for prompt_len, output_len in zip(prompt_lens.tolist(), output_lens.tolist(), strict=True):
        text, ids = corpus.prompt(rng, prompt_len)
        requests.append(BenchRequest(text, ids, output_len))
    return requests


def _lengths(
    rng: np.random.Generator, spec: WorkloadSpec, fixed: int | None, median: float, bounds: tuple[int, int]
) -> np.ndarray:
    if fixed is not None:
        return np.full(spec.num_requests, fixed, dtype=np.int64)
    return lognormal_lengths(rng, spec.num_requests, median, spec.sigma, bounds)


def _shared_prefix_requests(
    rng: np.random.Generator,
    spec: WorkloadSpec,
    corpus: TokenCorpus,
    question_lens: np.ndarray,
    output_lens: np.ndarray,
) -> list[BenchRequest]:
    """K system prompts of `prefix_len` tokens, each request one of them plus its own question.

    Token ids are the prefix's ids followed by the question's, so every request with the same
    system prompt starts with exactly the same tokens (what a prefix cache can reuse).
    """
    prefixes = [corpus.prompt(rng, spec.prefix_len) for _ in range(spec.shared_prefixes)]
    choices = rng.integers(spec.shared_prefixes, size=spec.num_requests)
    requests = []
    for choice, question_len, output_len in zip(
        choices.tolist(), question_lens.tolist(), output_lens.tolist(), strict=True
    ):
        prefix_text, prefix_ids = prefixes[choice]
        question_text, question_ids = corpus.prompt(rng, question_len)
        requests.append(BenchRequest(prefix_text + question_text, prefix_ids + question_ids, output_len))
    return requests


def save_jsonl(requests: Iterable[BenchRequest], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for request in requests:
            out.write(json.dumps(request.to_json()) + "\n")
    return path


def load_jsonl(path: str | os.PathLike, tokenizer: Tokenizer | None = None) -> list[BenchRequest]:
    """Read a workload file; a line without `prompt_token_ids` is tokenized with `tokenizer`."""
    requests = []
    with Path(path).open() as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                requests.append(_request_from_json(json.loads(line), tokenizer, f"{path}:{number}"))
    if not requests:
        raise ValueError(f"workload {path} has no requests")
    return requests


def _request_from_json(obj: dict, tokenizer: Tokenizer | None, where: str) -> BenchRequest:
    if not isinstance(obj.get("max_tokens"), int) or obj["max_tokens"] < 1:
        raise ValueError(f"{where}: every request needs an integer max_tokens >= 1")
    prompt = obj.get("prompt", "")
    ids = obj.get("prompt_token_ids")
    if ids is None:
        if tokenizer is None or not prompt:
            raise ValueError(f"{where}: a request needs prompt_token_ids, or a prompt and a tokenizer")
        ids = tokenizer.encode(prompt)
    return BenchRequest(prompt, [int(t) for t in ids], obj["max_tokens"])


def describe(requests: Sequence[BenchRequest]) -> dict[str, float]:
    """Length statistics, printed and stored with every result so workloads can be told apart."""
    prompt = np.array([r.prompt_len for r in requests])
    output = np.array([r.max_tokens for r in requests])
    return {
        "num_requests": len(requests),
        "prompt_tokens": int(prompt.sum()),
        "output_tokens": int(output.sum()),
        "prompt_len_median": float(np.median(prompt)),
        "prompt_len_max": int(prompt.max()),
        "output_len_median": float(np.median(output)),
        "output_len_max": int(output.max()),
    }
