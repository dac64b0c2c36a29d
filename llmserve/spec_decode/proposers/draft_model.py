"""Model drafts: a smaller model with the target's tokenizer, or the target's own first layers.

The proposer runs after each step's sampling, for the next step, for the requests that got new
tokens: one forward catches the draft up to the request's newest token, then k - 1 single-token
forwards propose the rest (batched across requests; greedy for greedy requests, sampled from the
processed draft distribution q, which the proposal carries for the rejection sampler, otherwise).

Its paged KV pool has as many blocks as the target's and is addressed through the target's block
tables, so allocation, rollback of rejected drafts, preemption and freeing need no bookkeeping of
their own: the draft writes its KV at positions the scheduler has given slots for, the new token's
and its drafts' in lookahead slots reserved past the step's tokens (core/draft_planner.py); a
request gets only as many drafts as those slots hold. The proposer tracks how much of each request's
draft KV is valid: KV written past the request's computed tokens may sit in blocks that the
scheduler frees after the step (rejected drafts, lookahead) and hands out again, so only the blocks
the step keeps count, and only while the request's block table still holds them (a copy on write
replaces a block).

The early-exit draft (`early_exit`) shares even the KV: its layers are the target's first L layers, so
their KV at verified positions is the target's own and it catches up on the new token only.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.config import EngineArgs, EngineConfig, ModelArchConfig
from llmserve.config.speculative import SpeculativeConfig
from llmserve.core.kv_cache_manager import cdiv
from llmserve.model_loader import load_arch_config, load_weights, resolve_model_path
from llmserve.models.registry import build_model
from llmserve.request import DraftProposal
from llmserve.sample.speculative import (
    build_row_metadata,
    exponential_race,
    greedy_rows,
    process_logits,
    uniform_rows,
)
from llmserve.spec_decode.proposer import SampledBatch
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.request_state import CachedRequestState

logger = logging.getLogger("llmserve")

# 28 of SmolLM2's 30: no depth pays there, the deepest accepts most (docs/speculative.md, "Early exit").
DEFAULT_EARLY_EXIT_FRACTION = 0.93


@dataclass
class _DraftSequence:
    """A request as the draft model sees it: known tokens plus drafts so far, how many have draft KV,
    and the target's block table (a BatchRow for InputBuilder, worker/step_inputs.py; no drafts)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    spec_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class _DraftKV:
    """Draft KV held for one request: its first `num_tokens` tokens, then `drafts` (maybe rejected);
    only the positions in `blocks` (the leading table entries the step kept) survive for certain."""

    num_tokens: int
    drafts: list[int]
    num_resumptions: int
    blocks: tuple[int, ...]


class EarlyExitModel(nn.Module):
    """The target's first `num_layers` decoder layers, then its final norm and lm_head (shared weights)."""

    def __init__(self, target: nn.Module, num_layers: int) -> None:
        super().__init__()
        total = len(target.model.layers)
        if not 1 <= num_layers <= total:
            raise ValueError(f"early-exit draft layers must be in [1, {total}], got {num_layers}")
        self.target = target
        self.num_layers = num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        inner = self.target.model
        hidden = inner.embed_tokens(input_ids)
        for layer in inner.layers[: self.num_layers]:
            hidden = layer(positions, hidden)
        return inner.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    def attention_layers(self) -> list:
        return self.target.attention_layers()[: self.num_layers]


class DraftModelProposer(ModelRunner):
    """The Proposer of `draft` and `early_exit`: a model runner for the draft model whose job is
    `propose` (its inherited `execute` is unused)."""

    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        target_requests: dict[str, CachedRequestState],
        spec: SpeculativeConfig,
        shared_kv_cache: torch.Tensor | None = None,
    ) -> None:
        self._shared_kv_cache = shared_kv_cache  # read by _allocate_kv_cache during super().__init__
        super().__init__(config, model)
        self.target_requests = target_requests  # the target runner's: their block tables address our KV
        self.spec = spec
        self._draft_kv: dict[str, _DraftKV] = {}

    @property
    def shares_target_kv(self) -> bool:
        return self._shared_kv_cache is not None

    def _uses_static_decode(self) -> bool:
        return False  # it drafts through propose, never the decode step the graphs replay

    def _allocate_kv_cache(self) -> torch.Tensor:
        if self._shared_kv_cache is not None:
            return self._shared_kv_cache  # the layers are the target's, already bound to these views
        return super()._allocate_kv_cache()

    @torch.inference_mode()
    def propose(self, batch: SampledBatch) -> dict[str, DraftProposal | None]:
        """Draft for every request of the batch with K > 0 and lookahead slots; the proposal carries
        each sampling request's [k, V] q (greedy requests need none)."""
        self._forget_finished()
        counts = [self._num_drafts(batch, index) for index in range(len(batch.requests))]
        chosen = [i for i, k in enumerate(counts) if k > 0]
        proposals: dict[str, DraftProposal | None] = {r.request_id: None for r in batch.requests}
        if not chosen:
            return proposals
        requests, counts = [batch.requests[i] for i in chosen], [counts[i] for i in chosen]
        new_token_ids = [batch.new_token_ids[i] for i in chosen]
        sequences = [self._sequence(r, ids) for r, ids in zip(requests, new_token_ids, strict=True)]
        drafts: list[list[int]] = [[] for _ in chosen]
        probs = None
        for step in range(max(counts)):
            rows = [i for i, k in enumerate(counts) if k > step]
            logits = self._draft_logits([sequences[i] for i in rows])
            tokens_before = [new_token_ids[i] + drafts[i] for i in rows]
            tokens, step_probs = self._sample(logits, [requests[i] for i in rows], tokens_before)
            if step_probs is not None:
                if probs is None:
                    probs = torch.zeros(len(chosen), max(counts), step_probs.shape[-1], device=self.device)
                probs[rows, step] = step_probs
            for i, token in zip(rows, tokens, strict=True):
                drafts[i].append(token)
                sequences[i].all_token_ids.append(token)
        for i, (request, request_drafts) in enumerate(zip(requests, drafts, strict=True)):
            samples = probs is not None and not request.sampling_params.is_greedy
            num_tokens = request.num_tokens + len(new_token_ids[i])
            proposals[request.request_id] = DraftProposal(
                num_tokens, request_drafts, probs[i, : len(request_drafts)] if samples else None
            )
            # KV now covers the known tokens and every draft but the last (never fed back); the step
            # keeps the blocks of the tokens computed once this step's are appended (num_tokens - 1).
            kept = request.block_ids[: cdiv(num_tokens - 1, self.block_size)]
            self._draft_kv[request.request_id] = _DraftKV(
                num_tokens, request_drafts[:-1], request.num_resumptions, tuple(kept)
            )
        return proposals

    def _num_drafts(self, batch: SampledBatch, index: int) -> int:
        """K for request `index`, within the slots its block table holds past its newest token (the
        new token's KV and k - 1 drafts' go there)."""
        request = batch.requests[index]
        k = batch.draft_limit(index, self.spec.drafts_for(request.sampling_params))
        if k == 0:
            return 0
        slots = len(request.block_ids) * self.block_size
        return max(0, min(k, slots - (batch.num_tokens(index) - 1)))

    def _forget_finished(self) -> None:
        """Forget requests the target runner no longer holds (finished, aborted)."""
        live = self.target_requests
        for request_id in [r for r in self._draft_kv if r not in live]:
            del self._draft_kv[request_id]

    def _sequence(self, request: CachedRequestState, new_token_ids: list[int]) -> _DraftSequence:
        tokens = request.all_token_ids + new_token_ids
        return _DraftSequence(
            request.request_id, tokens, self._num_valid_kv(request, tokens), request.block_ids
        )

    def _num_valid_kv(self, request: CachedRequestState, tokens: list[int]) -> int:
        """Leading positions whose draft KV holds the request's actual `tokens` (never the newest one,
        which no forward has seen yet)."""
        if self.shares_target_kv:
            return len(tokens) - 1  # the target's own KV, computed up to the newest token
        held = self._draft_kv.get(request.request_id)
        if held is None or held.num_resumptions != request.num_resumptions:
            return 0  # new, or preempted since (its blocks were freed or moved)
        actual = tokens[held.num_tokens : held.num_tokens + len(held.drafts)]
        matched = next(
            (i for i, (a, b) in enumerate(zip(held.drafts, actual, strict=False)) if a != b), len(actual)
        )
        return min(held.num_tokens + matched, self._num_kept_slots(request, held), len(tokens) - 1)

    def _num_kept_slots(self, request: CachedRequestState, held: _DraftKV) -> int:
        """Positions in the leading blocks that the request's table still holds as they were when the
        draft last wrote them (a copy on write replaces a block)."""
        table = request.block_ids
        if tuple(table[: len(held.blocks)]) == held.blocks:
            return len(held.blocks) * self.block_size
        pairs = zip(held.blocks, table, strict=False)
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(held.blocks), len(table)))
        return same * self.block_size

    def _draft_logits(self, sequences: list[_DraftSequence]) -> torch.Tensor:
        """Catch each sequence up to its last token; [len(sequences), V] logits there, in that order."""
        inputs = self.input_builder.build([(s, s.num_tokens - s.num_computed_tokens) for s in sequences])
        hidden = self._forward(inputs)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        row_of = {id(inputs.requests[row]): i for i, row in enumerate(inputs.sample_rows)}
        for sequence in sequences:
            sequence.num_computed_tokens = sequence.num_tokens
        return logits[[row_of[id(s)] for s in sequences]]

    def _sample(
        self, logits: torch.Tensor, requests: list[CachedRequestState], drafts_before: list[list[int]]
    ) -> tuple[list[int], torch.Tensor | None]:
        """Next draft per row (argmax for greedy requests, else drawn from q) and q when any row samples."""
        metadata = build_row_metadata(requests, drafts_before, self.vocab_size, self.device)
        greedy_ids, processed = process_logits(logits, metadata)
        if metadata.all_greedy:
            return greedy_ids.tolist(), None
        probs = processed.softmax(dim=-1)
        greedy = greedy_rows(metadata, len(requests), self.device)
        is_random = (~greedy).tolist()
        noise = uniform_rows(
            [1] * len(requests), metadata.generators, is_random, self.device, probs.shape[-1]
        )
        return torch.where(greedy, greedy_ids, exponential_race(probs, noise)).tolist(), probs


def _draft_config(config: EngineConfig) -> EngineConfig:
    """The draft never swaps (a preempted request's draft KV is recomputed), takes no drafts itself and
    runs no LoRA adapter (its drafts are the base model's; the target verifies them adapted)."""
    cache = dataclasses.replace(config.cache, num_swap_blocks=0)
    return dataclasses.replace(config, cache=cache, speculative=None, lora=None)


def create_early_exit_proposer(
    config: EngineConfig, target: nn.Module, target_runner: ModelRunner
) -> DraftModelProposer:
    """`--speculative-method early_exit`: the target's first layers, on the target's own KV."""
    spec = config.speculative
    layers = spec.draft_layers or default_early_exit_layers(config.model.arch.num_hidden_layers)
    logger.info("speculative decoding: early-exit draft of %d target layers", layers)
    return DraftModelProposer(
        _draft_config(config),
        EarlyExitModel(target, layers),
        target_runner.requests,
        spec,
        shared_kv_cache=target_runner.kv_cache[:layers],
    )


def create_draft_model_proposer(
    config: EngineConfig, target: nn.Module, target_runner: ModelRunner
) -> DraftModelProposer:
    """`--speculative-method draft`: `--speculative-draft-model`, with a KV pool of its own."""
    spec = config.speculative
    if config.cache.sliding_window:
        # The draft catches up on a request's whole context after the target's prefill, by when the
        # window has freed the oldest blocks; early exit shares the target's KV and has no such gap.
        raise ValueError(
            "speculative_method draft does not support a sliding-window KV cache; use ngram or early_exit"
        )
    path = resolve_model_path(spec.draft_model)
    arch = load_arch_config(path)
    if arch.vocab_size != config.model.arch.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({arch.vocab_size} tokens) differs from the target's "
            f"({config.model.arch.vocab_size}): it must share the target's tokenizer"
        )
    model_config = dataclasses.replace(config.model, path=path, arch=arch)
    model = build_model(model_config, load_weights(path, model_config.dtype))
    logger.info("speculative decoding: draft model %s (%d layers)", path, arch.num_hidden_layers)
    draft_config = dataclasses.replace(_draft_config(config), model=model_config)
    return DraftModelProposer(draft_config, model, target_runner.requests, spec)


def load_draft_arch(args: EngineArgs) -> ModelArchConfig | None:
    """The draft model's architecture when one is configured, to size the shared KV memory."""
    if args.speculative_method != "draft" or not args.speculative_draft_model:
        return None
    return load_arch_config(resolve_model_path(args.speculative_draft_model))


def default_early_exit_layers(num_layers: int) -> int:
    """DEFAULT_EARLY_EXIT_FRACTION of the layers, and at least one fewer than the target has."""
    return max(1, min(num_layers - 1, round(num_layers * DEFAULT_EARLY_EXIT_FRACTION)))
