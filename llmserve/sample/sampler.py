"""Turns a batch of next-token logits into token ids, fully vectorized and without host syncs.

Order: min_tokens masking, penalties, greedy argmax, temperature, top-k, top-p, min-p, then sampling
by the exponential race (argmax of probs / Exponential(1) noise), which needs no cumulative sums and
lets every seeded row draw its noise from its own generator: a seeded request then gets the same
tokens whatever else is in the batch and wherever its row is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.sample.metadata import SamplingMetadata

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs_token_ids: torch.Tensor | None  # [B, N] int64 ids of the top-N processed log-probs
    logprobs: torch.Tensor | None  # [B, N] float32 top-N log-probs of the processed distribution
    sampled_logprobs: torch.Tensor | None  # [B] float32 log-prob of the sampled token, same distribution


class Sampler:
    """Stateless: everything per step comes in the SamplingMetadata."""

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.all_greedy and leaves_logits_unchanged(metadata):  # the argmax of the raw logits
            return SamplerOutput(greedy_token_ids(logits), None, None, None)
        logits = logits.to(torch.float32, copy=True)  # compute in float32; never touch the caller's
        apply_min_tokens(logits, metadata)
        logits = apply_penalties(logits, metadata)
        apply_logits_processors(logits, metadata)
        if metadata.all_greedy:
            return _output(logits, greedy_token_ids(logits), metadata)
        greedy_ids = greedy_token_ids(logits) if metadata.greedy_mask is not None else None
        logits = apply_temperature(logits, metadata.temperature)
        logits = apply_top_k_top_p(logits, metadata)
        logits = apply_min_p(logits, metadata.min_p)
        sampled = exponential_race(logits.softmax(dim=-1), metadata)
        if greedy_ids is not None:
            sampled = torch.where(metadata.greedy_mask, greedy_ids, sampled)
        return _output(logits, sampled, metadata)


def leaves_logits_unchanged(metadata: SamplingMetadata) -> bool:
    """No min_tokens masking, no penalties, no logits processors and no logprobs: a greedy row's token
    is its raw argmax."""
    return (
        metadata.logits_processing is None
        and metadata.max_num_logprobs is None
        and metadata.min_tokens_rows is None
        and metadata.repetition_penalties is None
        and metadata.output_token_counts is None
    )


def greedy_token_ids(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64 argmax of each row (the first of equal maxima). On the CPU the compiled kernel
    (kernels/csrc/greedy.cpp) reads bf16 or float32 rows in place, several threads and vectors at a
    time, where torch's argmax needs a float32 copy and reduces each row on one thread."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32):
        ops = load_cpu_ops()
        if ops is not None:
            return ops.greedy_sample(logits.contiguous())
    return logits.argmax(dim=-1)


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place: rows short of min_tokens cannot pick their EOS or stop token ids."""
    if metadata.min_tokens_rows is not None:
        logits[metadata.min_tokens_rows, metadata.min_tokens_token_ids] = _NEG_INF


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place: the logits processors rows need (sample/logits_processors.py)."""
    if metadata.logits_processing is not None:
        metadata.logits_processing.apply(logits)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (CTRL: shrink seen tokens' logits towards less likely), then OpenAI frequency/presence."""
    if metadata.repetition_penalties is not None:
        penalty = metadata.repetition_penalties.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(metadata.seen_token_mask, penalized, logits)
    if metadata.output_token_counts is not None:
        counts = metadata.output_token_counts
        logits = logits - metadata.frequency_penalties.unsqueeze(1) * counts
        logits = logits - metadata.presence_penalties.unsqueeze(1) * (counts > 0)
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    return logits if temperature is None else logits / temperature.unsqueeze(1)


def apply_top_k_top_p(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Mask tokens outside each row's top-k, then outside its minimal top-p nucleus.

    Both become a per-row threshold on the logits (no scatter back from sorted order), so ties with
    the last kept token are kept too.
    """
    if metadata.top_k is not None:
        logits = _top_k(logits, metadata.top_k, metadata.max_top_k)
    if metadata.top_p is not None:
        logits = _top_p(logits, metadata.top_p, metadata.top_p_candidates)
    return logits


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """One topk(max_k) for the batch, then each row's k-th value as its threshold."""
    top_values = logits.topk(max_top_k, dim=-1).values
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    kth = kth.masked_fill((top_k >= logits.shape[-1]).unsqueeze(1), _NEG_INF)
    return logits.masked_fill(logits < kth, _NEG_INF)


def _top_p(logits: torch.Tensor, top_p: torch.Tensor, candidates: int) -> torch.Tensor:
    """Keep a token while the tokens above it hold less than top_p of the mass.

    `candidates` < V when every top-p row is also top-k limited: a topk() then replaces the full sort.
    """
    if candidates < logits.shape[-1]:
        sorted_logits = logits.topk(candidates, dim=-1).values
    else:
        sorted_logits = logits.sort(dim=-1, descending=True).values
    # the top token always stays: a top_p below float32's smallest value arrives here as 0
    num_kept = (mass_above(sorted_logits) < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = sorted_logits.gather(1, num_kept - 1)
    threshold = threshold.masked_fill((top_p >= 1.0).unsqueeze(1), _NEG_INF)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def mass_above(sorted_logits: torch.Tensor) -> torch.Tensor:
    """Each token's share of the probability held by the tokens ranked above it (logits sorted in
    descending order). Running sums in rank order, the total their last: a row's masked tail adds exact
    zeros, so its bits do not depend on how many candidates the batch's other rows need (a softmax's
    vectorized sum over the longer row would)."""
    weights = (sorted_logits - sorted_logits[:, :1]).exp_()
    running = weights.cumsum(dim=-1)
    return (running - weights) / running[:, -1:]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Drop p < min_p * p_max, compared in log space (l < l_max + log min_p) to skip a softmax."""
    if min_p is None:
        return logits
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def exponential_race(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """argmax(p / E) with E ~ Exponential(1) draws token i with probability p_i (Gumbel-max in disguise).

    E = -log(U), U ~ Uniform[0, 1): several times faster than exponential_() on CPU, and never 0
    (U < 1), so p / E is never NaN; U = 0 gives E = inf, which only makes that token lose.
    """
    shared = metadata.has_unseeded_random  # all-seeded batches leave the global generator alone
    noise = torch.rand_like(probs) if shared else torch.full_like(probs, 0.5)
    for row in metadata.seeded_rows:  # a loop over seeded rows only: each has its own stream
        noise[row].uniform_(generator=metadata.generators[row])
    return probs.div_(noise.log_().neg_()).argmax(dim=-1)


def _output(logits: torch.Tensor, sampled: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
    if metadata.max_num_logprobs is None:
        return SamplerOutput(sampled, None, None, None)
    logprobs = logits.log_softmax(dim=-1)
    top = logprobs.topk(min(metadata.max_num_logprobs, logprobs.shape[-1]), dim=-1)
    sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
    return SamplerOutput(sampled, top.indices, top.values, sampled_logprobs)
