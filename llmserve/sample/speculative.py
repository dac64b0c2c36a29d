"""Speculative decoding's sampling: the sampler's processing applied per draft position, for the
target's p and the draft's q alike.

A request verifying k drafts has k + 1 target rows; row j judges the token that follows the first j
drafts, so its penalties and min_tokens see the output plus those j drafts, exactly as if the drafts
had been generated one step at a time. The draft model's step j sees the same context, so p and q
are processed identically (same min_tokens masking, penalties, temperature, top-k/top-p, min-p).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmserve.sample.metadata import SamplingMetadata, SamplingRequest
from llmserve.sample.sampler import (
    apply_logits_processors,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    greedy_token_ids,
)


def build_row_metadata(
    requests: Sequence[SamplingRequest],
    drafts_before: Sequence[list[int]],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """One row per (request, position): `drafts_before[i]` are the drafts that precede row i."""
    return SamplingMetadata.build(
        params=[r.sampling_params for r in requests],
        prompt_token_ids=[r.prompt_token_ids for r in requests],
        output_token_ids=[
            r.output_token_ids + drafts for r, drafts in zip(requests, drafts_before, strict=True)
        ],
        generators=[r.generator for r in requests],
        eos_token_ids=[r.eos_token_ids for r in requests],
        vocab_size=vocab_size,
        device=device,
        grammars=[r.grammar for r in requests],
    )


def expand_rows(
    requests: Sequence[SamplingRequest], num_rows: Sequence[int]
) -> tuple[list[SamplingRequest], list[list[int]]]:
    """Request i repeated num_rows[i] times, with the drafts before each of its rows (row j: the first j)."""
    rows: list[SamplingRequest] = []
    drafts_before: list[list[int]] = []
    for request, count in zip(requests, num_rows, strict=True):
        rows.extend([request] * count)
        drafts_before.extend(request.spec_token_ids[:j] for j in range(count))
    return rows, drafts_before


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy token per row, processed float32 logits), in the Sampler's order: min_tokens, penalties,
    logits processors, argmax for greedy rows, then temperature, top-k/top-p and min-p (neutral on
    greedy rows)."""
    logits = logits.to(torch.float32, copy=True)
    apply_min_tokens(logits, metadata)
    logits = apply_penalties(logits, metadata)
    apply_logits_processors(logits, metadata)
    greedy_ids = greedy_token_ids(logits)
    if metadata.all_greedy:
        return greedy_ids, logits
    logits = apply_temperature(logits, metadata.temperature)
    logits = apply_top_k_top_p(logits, metadata)
    return greedy_ids, apply_min_p(logits, metadata.min_p)


def greedy_rows(metadata: SamplingMetadata, num_rows: int, device: torch.device) -> torch.Tensor:
    """[num_rows] bool: which metadata rows decode greedily."""
    if metadata.greedy_mask is not None:
        return metadata.greedy_mask
    return torch.full((num_rows,), metadata.all_greedy, dtype=torch.bool, device=device)


def uniform_rows(
    counts: Sequence[int],
    generators: Sequence[torch.Generator | None],
    is_random: Sequence[bool],
    device: torch.device,
    width: int | None = None,
) -> torch.Tensor:
    """U[0, 1) noise, `counts[i]` rows for request i ([sum, width], or [sum] without a width).

    A seeded random request draws its rows from its own generator, so its tokens do not depend on
    the batch; greedy requests draw nothing (their rows hold 0.5), and a batch whose random requests
    are all seeded leaves the global generator alone, as in the Sampler.
    """
    total = sum(counts)
    shape = (total,) if width is None else (total, width)
    shared = any(r and g is None and c for c, g, r in zip(counts, generators, is_random, strict=True))
    noise = torch.rand(shape, device=device) if shared else torch.full(shape, 0.5, device=device)
    offset = 0
    for count, generator, random in zip(counts, generators, is_random, strict=True):
        if random and generator is not None and count:
            noise[offset : offset + count].uniform_(generator=generator)
        offset += count
    return noise


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(p / E), E = -log(U) ~ Exponential(1): draws token i with probability p_i / sum(p), so
    unnormalized weights (a residual max(0, p - q)) need no division."""
    return probs.div(noise.log().neg_()).argmax(dim=-1)
