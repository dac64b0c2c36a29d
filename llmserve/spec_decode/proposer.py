"""The one drafting interface: after each step's sampling, a proposer drafts for the next step.

    schedule (DraftPlanner takes proposals) -> execute (forward, sample or verify)
        -> Proposer.propose(SampledBatch) -> the scheduler appends the new tokens

The engine calls `propose` once per step in which speculation is on, after the model runner sampled
(or verified drafts) and before the scheduler appends the new tokens. The proposer returns a
`DraftProposal` (request.py) for each request it drafts for: drafts to follow the request's tokens
plus the ones this step gave it, and the q they were drawn from where the request samples. The
scheduler keeps the drafts and the model runner the q; at the next step the scheduler's
`DraftPlanner` (core/draft_planner.py) takes as many drafts as the token budget and the request's
limits allow, and the model runner verifies them (sample/verifier.py).

Proposers, by `--speculative-method` (registry.py):
- ngram (proposers/ngram.py): prompt lookup on the host, no model;
- draft, early_exit (proposers/draft_model.py): a smaller model, or the target's first layers; they
  write draft KV into slots the scheduler reserved past the step's tokens (lookahead);
- draft_head (proposers/draft_head.py): prompt lookup, else a head run on the target's last hidden
  state (`SampledBatch.last_hidden`).
- suffix (proposers/suffix.py): the most frequent continuation of the context's suffix in the request's
  own text and in recent requests' outputs, on the host, no model.
- medusa (proposers/medusa.py), eagle (proposers/eagle.py): a token tree (`DraftProposal.parents`,
  sample/token_tree.py) from Medusa heads' top-k, or from the draft head expanded by its top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from llmserve.core.step_plan import StepPlan
from llmserve.request import DraftProposal
from llmserve.worker.model_runner import ModelRunnerOutput
from llmserve.worker.request_state import CachedRequestState


@dataclass
class SampledBatch:
    """The requests a step gave new tokens, in the model runner's sampling order."""

    requests: list[CachedRequestState]
    new_token_ids: list[list[int]]  # per request: the tokens this step gave it (not yet appended to it)
    # [rows, H]: the target's final hidden state at each sampling row, k + 1 rows for a request that
    # verified k drafts (row j judged the token after its first j drafts), one row otherwise
    hidden: torch.Tensor
    max_drafts: int | None = None  # auto mode: drafts per request at most at this batch size
    # adaptive K: request id -> drafts at most, where its acceptance leaves fewer than its K
    draft_limits: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_step(cls, plan: StepPlan, output: ModelRunnerOutput) -> SampledBatch:
        requests = output.sampled_requests
        new_token_ids = [output.sampled_token_ids[r.request_id] for r in requests]
        return cls(requests, new_token_ids, output.sample_hidden, plan.max_drafts, plan.draft_limits)

    def num_tokens(self, index: int) -> int:
        """Request `index`'s tokens once this step's are appended: the length its drafts follow."""
        return self.requests[index].num_tokens + len(self.new_token_ids[index])

    def context(self, index: int) -> list[int]:
        """Request `index`'s tokens including this step's."""
        return self.requests[index].all_token_ids + self.new_token_ids[index]

    def draft_limit(self, index: int, k: int) -> int:
        """Drafts worth proposing for request `index`, at most `k`: within the auto-mode share, its
        adaptive-K limit and short of its max_tokens (verifying k drafts yields up to k + 1 tokens).
        Zero for a request whose first token this step sampled: its first token leaves with the step
        that finished its prompt, before any drafting for it (a draft model's catch-up on the prompt
        included); it drafts from its first decode on."""
        request = self.requests[index]
        if request.num_output_tokens == 0:
            return 0
        left = request.sampling_params.max_tokens - request.num_output_tokens - len(self.new_token_ids[index])
        cap = k if self.max_drafts is None else min(k, self.max_drafts)
        cap = min(cap, self.draft_limits.get(request.request_id, cap))
        return max(0, min(cap, left - 1))

    def last_hidden(self) -> torch.Tensor:
        """[len(requests), H]: for each request, the hidden state its last new token was sampled from
        (row j of its k + 1 verify rows after j accepted drafts)."""
        counts = np.array([len(r.spec_token_ids) + 1 for r in self.requests], dtype=np.int64)
        num_new = np.array([len(ids) for ids in self.new_token_ids], dtype=np.int64)
        rows = np.cumsum(counts) - counts + num_new - 1
        if len(rows) == len(self.hidden):
            return self.hidden
        return self.hidden[torch.from_numpy(rows).to(self.hidden.device, non_blocking=True)]


@runtime_checkable
class Proposer(Protocol):
    """Drafts for the next step, from a step's sampled batch."""

    def propose(self, batch: SampledBatch) -> dict[str, DraftProposal | None]:
        """For each request of `batch`, by id: a `DraftProposal` for `batch.num_tokens(i)` tokens with
        at most `batch.draft_limit(i, k)` drafts, or None where it proposes nothing. Host syncs only
        to read drafts back, no loop over a request's tokens."""
        ...
