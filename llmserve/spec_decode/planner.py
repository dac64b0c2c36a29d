"""The scheduler's side of speculative decoding: whether a step speculates, and how many drafts each
decoding request verifies.

A request verifying k drafts catches up by 1 + k tokens (its last sampled token and the drafts) under
the same token budget as everything else. N-gram drafts are proposed right here, on the host, and a
draft head's were proposed at the end of the previous step (proposers/draft_head.py), so the budget
and KV slots reserved are exactly what is verified; a draft model fills in the planned number of
drafts on the device just before the target's forward (see proposers/draft_model.py).
"""

from __future__ import annotations

import numpy as np

from llmserve.request import Request
from llmserve.spec_decode.config import SpeculativeConfig
from llmserve.spec_decode.proposers.ngram import NgramProposer


class DraftPlanner:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.ngram = None
        if config.method == "ngram" or (config.method == "draft_head" and config.prompt_lookup_max):
            self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.uses_head = config.method == "draft_head"

    def is_enabled(self, num_running: int) -> bool:
        """Auto-disable: verifying 1 + k tokens per request costs little while a step is bound by reading
        the weights (small batches) but adds real compute once the batch is large, where rejected
        drafts then cost more than accepted ones save."""
        limit = self.config.disable_batch_size
        return limit == 0 or num_running <= limit

    def drafts_per_request(self, num_running: int) -> int | None:
        """Auto mode: the drafts each of `num_running` decodes may verify so that the step stays within
        `max_verify_rows` rows (1 + k each): 7 for one request, 3 for two, none from three, since a
        share of one draft (three or four requests) measured 0.85-0.96x of not speculating (a head
        step and a verify row each for half a token); None where speculation is not auto (no cap)."""
        limit = self.config.max_verify_rows
        if self.config.disable_batch_size == 0 or limit == 0 or num_running == 0:
            return None
        share = max(limit - num_running, 0) // num_running
        return share if share >= 2 else 0

    def plan(self, request: Request, max_drafts: int) -> int:
        """Drafts `request` verifies this step (at most `max_drafts`); n-gram drafts are set on it now.

        K is the request's `SamplingParams.num_speculative_tokens` when set (0 turns speculation off
        for it), else the engine's `--num-speculative-tokens`. With a draft head, prompt lookup goes
        first (on a match its drafts are right more often than the head's) and the head's proposal
        for exactly this context fills in where it finds nothing.
        """
        k = request.sampling_params.num_speculative_tokens
        k = min(self.config.num_speculative_tokens if k is None else k, max_drafts)
        if k <= 0:
            return 0
        if self.ngram is None and not self.uses_head:
            return k  # a draft model proposes k on the device
        if self.ngram is not None:
            drafts = self.ngram.propose(np.asarray(request.all_token_ids, dtype=np.int64), k)
            if len(drafts) or not self.uses_head:
                request.spec_token_ids = drafts.tolist()
                return len(drafts)
        proposal = request.draft_proposal
        if proposal is None or proposal.num_tokens != request.num_tokens:
            return 0  # none yet (the prompt is still being computed), or for an earlier context
        k = min(k, len(proposal.token_ids))
        request.spec_token_ids = proposal.token_ids[:k]
        request.spec_token_probs = None if proposal.probs is None else proposal.probs[:k]
        return k
