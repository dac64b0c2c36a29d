"""Perplexity through the engine's own model path, and batch-1 decode speed.

Each window of the text is one request (prompt = the window, one output token): the scheduler
prefills it in chunks and the model runner runs the real forward over the paged KV cache, so every
engine option (quantized weights, an 8-bit KV cache, a sliding window) is what gets measured. A
forward hook on the model reads the hidden states of each step's prompt chunk; their logits score
each next token of the window (the runner itself only computes logits of last tokens).

The default text is the interpreter's LICENSE file: real English prose on every machine, and not
part of the calibration corpus (the language reference and stdlib docstrings).
"""

from __future__ import annotations

import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass

import torch

from llmserve.sampling_params import SamplingParams

_LOGIT_ROWS = 256  # rows of logits materialized at once (a row is vocab_size floats)


@dataclass(frozen=True)
class PerplexityResult:
    tokens: int  # tokens scored (every window's first token has no prediction)
    windows: int
    nll: float  # mean negative log-likelihood, nats per token
    decode_ms_per_token: float | None

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def default_text_path() -> str:
    """The LICENSE of the running Python (held out from calibration)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    for base in (stdlib, os.path.join(sys.base_prefix, "lib", os.path.basename(stdlib))):
        path = os.path.join(base, "LICENSE.txt")
        if os.path.isfile(path):
            return path
    raise ValueError("no LICENSE.txt next to the Python standard library; pass --text FILE")


def windows(token_ids: list[int], context: int) -> list[list[int]]:
    """Consecutive, non-overlapping windows of `context` tokens (a shorter last one if >= 2)."""
    chunks = [token_ids[start : start + context] for start in range(0, len(token_ids), context)]
    return [chunk for chunk in chunks if len(chunk) >= 2]


class _Scorer:
    """A model runner hidden-state hook: sums the log-likelihood of each next token of the window
    being prefilled."""

    def __init__(self, model) -> None:
        self.model = model
        self.window: torch.Tensor | None = None
        self.offset = 0
        self.nll = 0.0

    def start(self, window: list[int]) -> None:
        self.window, self.offset = torch.tensor(window), 0

    def __call__(self, hidden: torch.Tensor) -> None:
        if self.window is None or self.offset >= len(self.window):
            return  # a step after the prompt (the sampled token): nothing to score
        rows = hidden.shape[0]
        targets = self.window[self.offset + 1 : self.offset + 1 + rows].to(hidden.device)
        for first in range(0, len(targets), _LOGIT_ROWS):
            part = targets[first : first + _LOGIT_ROWS]
            logits = self.model.compute_logits(hidden[first : first + len(part)])
            picked = logits.gather(-1, part[:, None])[:, 0]
            self.nll -= (picked - torch.logsumexp(logits, dim=-1)).sum().item()
        self.offset += rows


@torch.inference_mode()
def evaluate_perplexity(engine, token_ids: list[int], context: int, decode_tokens: int) -> PerplexityResult:
    """Score `token_ids` in windows of `context`, then time a batch-1 greedy decode."""
    if engine.config.parallel.world_size > 1:  # the scorer's logits would need every rank's block
        raise ValueError(
            "perplexity evaluation does not run under tensor parallelism or pipeline parallelism yet"
        )
    runner = engine.model_runner
    scorer = _Scorer(runner.model)
    runner.hidden_hooks.append(scorer)
    parts = windows(token_ids, context)
    try:
        for index, window in enumerate(parts):
            scorer.start(window)
            _run(engine, f"ppl-{index}", window, 1)
    finally:
        runner.hidden_hooks.remove(scorer)
    scored = sum(len(window) - 1 for window in parts)
    decode = decode_ms_per_token(engine, token_ids[:16], decode_tokens) if decode_tokens > 1 else None
    return PerplexityResult(scored, len(parts), scorer.nll / scored, decode)


def decode_ms_per_token(engine, prompt: list[int], num_tokens: int) -> float:
    """Mean time of the steps after the first token of one greedy request (EOS ignored)."""
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    engine.add_request("decode-timing", prompt, params)
    engine.step()  # the prefill, and the first token
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / max(steps, 1) * 1e3


def _run(engine, request_id: str, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
