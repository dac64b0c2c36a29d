"""Model drafts: a smaller model with the target's tokenizer, or the target's own first layers.

The proposer runs between the scheduler and the target's forward, for the requests the scheduler gave
k draft slots: one forward catches the draft up to the request's last sampled token, then k - 1
single-token forwards propose the rest (batched across requests; greedy for greedy requests, sampled
from the processed draft distribution q, which is recorded for the rejection sampler, otherwise).

Its paged KV pool has as many blocks as the target's and is addressed through the target's block
tables, so allocation, rollback of rejected drafts, preemption and freeing need no bookkeeping of
their own: the draft writes its KV at positions the scheduler has just given slots for (the verify
step then overwrites the target's KV there). The proposer only tracks how much of each request's draft
KV is valid, and copies blocks when the target copies on write.

The early-exit draft (`early_exit`) shares even the KV: its layers are the target's first L layers, so
their KV at verified positions is the target's own and it never catches up on anything.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.config import EngineArgs, EngineConfig, ModelArchConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.scheduler import SchedulerOutput
from llmserve.model_loader import load_arch_config, load_weights, resolve_model_path
from llmserve.models.registry import build_model
from llmserve.request import Request
from llmserve.spec_decode.sampling import (
    build_row_metadata,
    exponential_race,
    greedy_rows,
    process_logits,
    uniform_rows,
)
from llmserve.worker.forward_context import set_forward_context
from llmserve.worker.model_runner import ModelRunner

logger = logging.getLogger("llmserve")

# Default early-exit depth as a fraction of the target's layers (28 of SmolLM2's 30): on the default
# model no depth pays for itself (the model settles its token only in its last layers), and 28 tied
# with 8 for the fastest while accepting far more; docs/speculative.md has the measurement.
DEFAULT_EARLY_EXIT_FRACTION = 0.93


@dataclass
class _DraftSequence:
    """A request as the draft model sees it: known tokens plus drafts so far, and how many have draft KV.

    It quacks like a Request for ModelRunner._prepare_inputs (id, tokens, computed count, no drafts).
    """

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    spec_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class _DraftKV:
    """Draft KV held for one request: its first `num_tokens` tokens, then `drafts` (maybe rejected)."""

    num_tokens: int
    drafts: list[int]
    num_preemptions: int


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
    """A model runner for the draft model whose job is `propose` (its inherited `execute` is unused)."""

    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        kv_cache_manager: KVCacheManager,
        shared_kv_cache: torch.Tensor | None = None,
    ) -> None:
        self._shared_kv_cache = shared_kv_cache  # read by _allocate_kv_cache during super().__init__
        super().__init__(config, model, kv_cache_manager)
        self._draft_kv: dict[str, _DraftKV] = {}

    @property
    def shares_target_kv(self) -> bool:
        return self._shared_kv_cache is not None

    def _allocate_kv_cache(self) -> torch.Tensor:
        if self._shared_kv_cache is not None:
            return self._shared_kv_cache  # the layers are the target's, already bound to these views
        return super()._allocate_kv_cache()

    @torch.inference_mode()
    def propose(self, scheduled: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Set `spec_token_ids` of every request given draft slots; returns each one's [k, V] draft
        distributions when some request samples (greedy-only batches need no q)."""
        if not self.shares_target_kv:
            self._follow_target(scheduled)
        batch = [(r, k) for r in scheduled.requests if (k := scheduled.num_draft_tokens.get(r.request_id, 0))]
        if not batch:
            return {}
        requests, counts = [r for r, _ in batch], [k for _, k in batch]
        sequences = [self._sequence(r) for r in requests]
        drafts: list[list[int]] = [[] for _ in batch]
        probs = None
        for step in range(max(counts)):
            rows = [i for i, k in enumerate(counts) if k > step]
            logits = self._forward([sequences[i] for i in rows])
            tokens, step_probs = self._sample(logits, [requests[i] for i in rows], [drafts[i] for i in rows])
            if step_probs is not None:
                if probs is None:
                    probs = torch.zeros(len(batch), max(counts), step_probs.shape[-1], device=self.device)
                probs[rows, step] = step_probs
            for i, token in zip(rows, tokens, strict=True):
                drafts[i].append(token)
                sequences[i].all_token_ids.append(token)
        for request, request_drafts in zip(requests, drafts, strict=True):
            request.spec_token_ids = request_drafts
            # KV now covers the known tokens and every draft but the last (never fed back).
            self._draft_kv[request.request_id] = _DraftKV(
                request.num_tokens, request_drafts[:-1], request.num_preemptions
            )
        if probs is None:
            return {}
        return {r.request_id: probs[i, :k] for i, (r, k) in enumerate(batch)}

    def _follow_target(self, scheduled: SchedulerOutput) -> None:
        """Mirror the target's copy-on-write copies, and forget requests whose blocks are gone."""
        if scheduled.block_copies:
            sources, destinations = map(list, zip(*scheduled.block_copies, strict=True))
            self.kv_blocks[:, :, destinations] = self.kv_blocks[:, :, sources]
        live = self.kv_cache_manager.block_tables
        for request_id in [r for r in self._draft_kv if r not in live]:
            del self._draft_kv[request_id]

    def _sequence(self, request: Request) -> _DraftSequence:
        return _DraftSequence(request.request_id, list(request.all_token_ids), self._num_valid_kv(request))

    def _num_valid_kv(self, request: Request) -> int:
        """Leading positions whose draft KV holds the request's actual tokens (never past the target's)."""
        if self.shares_target_kv:
            return request.num_computed_tokens
        held = self._draft_kv.get(request.request_id)
        if held is None or held.num_preemptions != request.num_preemptions:
            return 0  # new, or preempted since (its blocks were freed or moved)
        actual = request.all_token_ids[held.num_tokens : held.num_tokens + len(held.drafts)]
        matched = next(
            (i for i, (a, b) in enumerate(zip(held.drafts, actual, strict=False)) if a != b), len(actual)
        )
        return min(held.num_tokens + matched, request.num_computed_tokens)

    def _forward(self, sequences: list[_DraftSequence]) -> torch.Tensor:
        """Catch each sequence up to its last token; [len(sequences), V] logits there, in that order."""
        plan = SchedulerOutput(
            requests=sequences,  # duck-typed: _prepare_inputs reads ids, tokens and computed counts
            num_scheduled_tokens=[s.num_tokens - s.num_computed_tokens for s in sequences],
        )
        inputs = self._prepare_inputs(plan)
        with set_forward_context(inputs.attention):
            hidden = self.model(inputs.input_ids, inputs.positions)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        row_of = {id(inputs.requests[row]): i for i, row in enumerate(inputs.sample_rows)}
        for sequence in sequences:
            sequence.num_computed_tokens = sequence.num_tokens
        return logits[[row_of[id(s)] for s in sequences]]

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], drafts_before: list[list[int]]
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


def create_drafter(
    config: EngineConfig, target: nn.Module, target_runner: ModelRunner
) -> DraftModelProposer | None:
    """The device-side proposer that drafts before the target's forward (draft model, early exit)."""
    spec = config.speculative
    if spec is None or spec.method not in ("draft", "early_exit"):
        return None  # n-gram drafts come from the scheduler, a draft head's from the previous step
    # The draft never swaps (a preempted request's draft KV is recomputed) and takes no drafts itself.
    draft_config = dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, num_swap_blocks=0), speculative=None
    )
    if spec.method == "early_exit":
        layers = spec.draft_layers or default_early_exit_layers(config.model.arch.num_hidden_layers)
        logger.info("speculative decoding: early-exit draft of %d target layers", layers)
        model = EarlyExitModel(target, layers)
        return DraftModelProposer(
            draft_config,
            model,
            target_runner.kv_cache_manager,
            shared_kv_cache=target_runner.kv_cache[:layers],
        )
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
    return DraftModelProposer(
        dataclasses.replace(draft_config, model=model_config), model, target_runner.kv_cache_manager
    )


def load_draft_arch(args: EngineArgs) -> ModelArchConfig | None:
    """The draft model's architecture when one is configured, to size the shared KV memory."""
    if args.speculative_method != "draft" or not args.speculative_draft_model:
        return None
    return load_arch_config(resolve_model_path(args.speculative_draft_model))


def default_early_exit_layers(num_layers: int) -> int:
    """DEFAULT_EARLY_EXIT_FRACTION of the layers, and at least one fewer than the target has."""
    return max(1, min(num_layers - 1, round(num_layers * DEFAULT_EARLY_EXIT_FRACTION)))
