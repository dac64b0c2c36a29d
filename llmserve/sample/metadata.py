"""Per-step batch tensors for the sampler, built once on the host and moved to the logits' device.

Everything the sampler needs is decided here, from the requests' parameters: which stages run at all
(a tensor is None when no row uses its stage, so the common greedy or plain-temperature step does no
extra work) and the token counts penalties need. Greedy rows in a mixed batch get neutral values
(temperature 1, no top-k/top-p/min-p) so their log-probs describe the penalized distribution.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from llmserve.sample.logits_processors import LogitsProcessing
from llmserve.sample.transfer import to_device
from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmserve.structured.matcher import GrammarState


class SamplingRequest(Protocol):
    """What sampling and verification read of a request (the model runner's CachedRequestState)."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None
    spec_token_ids: list[int]  # the drafts it verifies this step
    grammar: GrammarState | None  # structured outputs: its matcher (created by the runner when it samples)

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass
class SamplingMetadata:
    """Row i describes request i of the batch; tensors live on the logits' device."""

    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [B] bool; only for batches mixing greedy and random rows
    temperature: torch.Tensor | None  # [B] float32; None when every row samples at temperature 1
    top_k: torch.Tensor | None  # [B] int64; vocab_size where disabled
    max_top_k: int  # largest enabled top_k, so top-k can run as one topk() call
    top_p: torch.Tensor | None  # [B] float32; 1.0 where disabled
    top_p_candidates: int  # tokens top-p must rank: max_top_k if every top-p row has a top-k, else V
    min_p: torch.Tensor | None  # [B] float32; 0.0 where disabled
    repetition_penalties: torch.Tensor | None  # [B] float32; 1.0 where disabled
    seen_token_mask: torch.Tensor | None  # [B, V] bool: token in prompt or output (repetition rows)
    frequency_penalties: torch.Tensor | None  # [B] float32
    presence_penalties: torch.Tensor | None  # [B] float32
    output_token_counts: torch.Tensor | None  # [B, V] float32 occurrences in the output (penalty rows)
    min_tokens_rows: torch.Tensor | None  # [M] int64 row of each (row, token) pair to suppress
    min_tokens_token_ids: torch.Tensor | None  # [M] int64 token of each pair
    generators: list[torch.Generator | None]
    seeded_rows: list[int]  # random rows that draw noise from their own generator
    has_unseeded_random: bool  # some random row draws from the shared (global) generator
    max_num_logprobs: int | None  # None when no row asked for logprobs
    vocab_size: int
    logits_processing: LogitsProcessing | None = None  # the logits processors rows need (None: none)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: list[tuple[int, ...]],
        vocab_size: int,
        device: torch.device,
        grammars: list[GrammarState | None] | None = None,
    ) -> SamplingMetadata:
        """`grammars`: each row's grammar state, needed when a row has structured outputs."""
        device = torch.device(device)
        greedy = [p.is_greedy for p in params]
        random_params = [p for p, g in zip(params, greedy, strict=True) if not g]
        all_greedy, all_random = not random_params, len(random_params) == len(params)
        seeded_rows = [i for i, (g, gen) in enumerate(zip(greedy, generators, strict=True)) if not g and gen]
        top_k = [_effective_top_k(p, g, vocab_size) for p, g in zip(params, greedy, strict=True)]
        enabled_top_k = [k for k in top_k if k < vocab_size]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None if all_greedy or all_random else to_device(torch.tensor(greedy), device),
            temperature=_row_values(params, greedy, lambda p: p.temperature, 1.0, device),
            top_k=to_device(torch.tensor(top_k, dtype=torch.int64), device) if enabled_top_k else None,
            max_top_k=max(enabled_top_k, default=0),
            top_p=_row_values(params, greedy, lambda p: p.top_p, 1.0, device),
            top_p_candidates=_top_p_candidates(params, greedy, top_k, vocab_size),
            min_p=_row_values(params, greedy, lambda p: p.min_p, 0.0, device),
            **_penalty_tensors(params, prompt_token_ids, output_token_ids, vocab_size, device),
            **_min_tokens_pairs(params, output_token_ids, eos_token_ids, vocab_size, device),
            generators=list(generators),
            seeded_rows=seeded_rows,
            has_unseeded_random=len(seeded_rows) < len(random_params),
            max_num_logprobs=max(logprobs, default=None),
            vocab_size=vocab_size,
            logits_processing=LogitsProcessing.build(params, output_token_ids, grammars),
        )


def _effective_top_k(params: SamplingParams, greedy: bool, vocab_size: int) -> int:
    """top_k as the sampler applies it: vocab_size (a no-op) when disabled, greedy or too large."""
    if greedy or params.top_k < 1:
        return vocab_size
    return min(params.top_k, vocab_size)


def _top_p_candidates(params, greedy, top_k: list[int], vocab_size: int) -> int:
    """How many top tokens top-p must rank: the top-p rows' largest top_k (V if one has none)."""
    top_p_ks = [k for p, g, k in zip(params, greedy, top_k, strict=True) if not g and p.top_p < 1.0]
    return max(top_p_ks) if top_p_ks and max(top_p_ks) < vocab_size else vocab_size


def _row_values(params, greedy, get, neutral: float, device: torch.device) -> torch.Tensor | None:
    """[B] float32 of get(params) for random rows, `neutral` for greedy ones; None if all neutral."""
    values = [neutral if g else float(get(p)) for p, g in zip(params, greedy, strict=True)]
    if all(v == neutral for v in values):
        return None
    return _floats(values, device)


def _penalty_tensors(params, prompt_token_ids, output_token_ids, vocab_size, device) -> dict:
    """Penalty factors and the token counts they need; only rows with that penalty are counted."""
    use_repetition = [p.repetition_penalty != 1.0 for p in params]
    use_additive = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
    tensors = dict.fromkeys(
        (
            "repetition_penalties",
            "seen_token_mask",
            "frequency_penalties",
            "presence_penalties",
            "output_token_counts",
        )
    )
    if any(use_repetition):
        prompt = [ids if use else [] for ids, use in zip(prompt_token_ids, use_repetition, strict=True)]
        output = [ids if use else [] for ids, use in zip(output_token_ids, use_repetition, strict=True)]
        seen = token_counts(prompt, vocab_size, device) + token_counts(output, vocab_size, device)
        tensors["seen_token_mask"] = seen > 0
        tensors["repetition_penalties"] = _floats([p.repetition_penalty for p in params], device)
    if any(use_additive):
        output = [ids if use else [] for ids, use in zip(output_token_ids, use_additive, strict=True)]
        tensors["output_token_counts"] = token_counts(output, vocab_size, device)
        tensors["frequency_penalties"] = _floats([p.frequency_penalty for p in params], device)
        tensors["presence_penalties"] = _floats([p.presence_penalty for p in params], device)
    return tensors


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.float32), device)


def token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32 occurrences of each token per row: one padded host array, one scatter_add."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = max(int(lengths.max(initial=0)), 1)
    valid = np.arange(width) < lengths[:, None]
    ids = np.zeros((len(rows), width), dtype=np.int64)
    ids[valid] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    weights = to_device(torch.from_numpy(valid.astype(np.float32)), device)
    return counts.scatter_add_(1, to_device(torch.from_numpy(ids), device), weights)


def _min_tokens_pairs(params, output_token_ids, eos_token_ids, vocab_size, device) -> dict:
    """(row, token) pairs to set to -inf: EOS and stop ids of rows still short of min_tokens."""
    rows: list[int] = []
    tokens: list[int] = []
    for row, (p, output, eos) in enumerate(zip(params, output_token_ids, eos_token_ids, strict=True)):
        if len(output) >= p.min_tokens:
            continue
        banned = sorted({t for t in (*eos, *p.stop_token_ids) if 0 <= t < vocab_size})
        rows.extend([row] * len(banned))
        tokens.extend(banned)
    if not rows:
        return {"min_tokens_rows": None, "min_tokens_token_ids": None}
    return {
        "min_tokens_rows": to_device(torch.tensor(rows, dtype=torch.int64), device),
        "min_tokens_token_ids": to_device(torch.tensor(tokens, dtype=torch.int64), device),
    }
