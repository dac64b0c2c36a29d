"""The scheduler's side of speculative decoding: whether a step speculates, and how many drafts each
decoding request verifies (at most its K, fewer where its drafts were rejected lately: adaptive K).

Drafts are proposed after each step, for the next one (spec_decode/proposer.py), and wait on the
request as a `DraftProposal`. A request verifying k of them catches up by 1 + k tokens (its last
sampled token and the drafts) under the same token budget as everything else, so the budget and the
KV slots reserved are exactly what is verified. A proposer that runs a model with a KV cache (draft,
early exit) writes the KV of the new token and of its drafts right after the step, so a speculating
step also reserves slots for that past its own tokens (`num_lookahead_tokens`).
"""

from __future__ import annotations

from llmserve.config.speculative import SpeculativeConfig
from llmserve.request import Request
from llmserve.sample.token_tree import is_chain


class DraftPlanner:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def is_enabled(self, num_running: int) -> bool:
        """Auto-disable: verifying 1 + k tokens per request costs little while a step is bound by reading
        the weights (small batches) but adds real compute once the batch is large, where rejected
        drafts then cost more than accepted ones save."""
        limit = self.config.disable_batch_size
        return limit == 0 or num_running <= limit

    def drafts_per_request(self, num_running: int) -> int | None:
        """Auto mode: the drafts each of `num_running` decodes may verify so that the step stays within
        `max_verify_rows` rows (1 + k each): 7 for one request, 3 for two, none from three, since a
        share of one draft costs a head step and a verify row for about half a token; None where
        speculation is not auto (no cap)."""
        limit = self.config.max_verify_rows
        if self.config.disable_batch_size == 0 or limit == 0 or num_running == 0:
            return None
        share = max(limit - num_running, 0) // num_running
        return share if share >= 2 else 0

    def speculation(self, num_running: int) -> tuple[bool, int | None]:
        """Whether a step of `num_running` requests speculates, and auto mode's drafts per request
        (None: no cap)."""
        if not self.is_enabled(num_running):
            return False, None
        share = self.drafts_per_request(num_running)
        return share != 0, share

    def plan_within(self, request: Request, budget: int, share: int | None, max_model_len: int) -> int:
        """Drafts a decoding request verifies this step. Every accepted draft is a generated token,
        so k stays within the step's token `budget`, `max_model_len` and the request's max_tokens (and
        within auto mode's `share` of verify rows, when set); a prompt chunk or a resumed request
        catches up first and verifies none."""
        request.clear_drafts()
        if request.num_tokens - request.num_computed_tokens != 1:
            return 0
        room = min(
            budget - 1,
            max_model_len - request.num_tokens - 1,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
            budget if share is None else share,
        )
        return self.plan(request, room) if room > 0 else 0

    def plan(self, request: Request, max_drafts: int) -> int:
        """Drafts `request` verifies this step (at most `max_drafts`), taken from the proposal made for
        exactly its current tokens and set on it as `spec_token_ids` (their q stays with the model
        runner that drafted them).

        K is the request's `SamplingParams.num_speculative_tokens` when set (0 turns speculation off
        for it), else the engine's `--num-speculative-tokens`, cut by adaptive K (`draft_length`).
        """
        k = min(self.draft_length(request), max_drafts)
        proposal = request.draft_proposal
        if k <= 0 or proposal is None or proposal.num_tokens != request.num_tokens:
            return 0  # none yet (the prompt is still being computed), or for an earlier context
        k = min(k, len(proposal.token_ids))
        request.spec_token_ids = proposal.token_ids[:k]
        # a token tree's first k drafts are a tree (parents come first); one that is a chain runs as one
        parents = None if proposal.parents is None else proposal.parents[:k]
        request.spec_tree_parents = None if parents is None or is_chain(parents) else parents
        return k

    def num_lookahead_tokens(self, request: Request, share: int | None) -> int:
        """KV slots to reserve past a sampling request's tokens for a proposer that writes draft KV
        after the step (draft, early exit): its new token and up to k - 1 drafts land there (k at
        most the auto-mode `share`). Zero for proposers without a KV cache."""
        if not self.config.writes_draft_kv:
            return 0
        k = self.draft_length(request)
        return k if share is None else min(k, share)

    def draft_length(self, request: Request) -> int:
        """The drafts `request` may verify at most: its K and, with adaptive K (`--speculative-adaptive-k`,
        the default), one more than it accepted per verify pass on average (`DraftAcceptance`), so
        a request whose drafts are rejected costs few verify rows and one whose drafts are accepted
        grows back to K; auto mode's share (`drafts_per_request`) still applies on top."""
        k = self.config.drafts_for(request.sampling_params)
        return request.draft_acceptance.limit(k) if self.config.adaptive_k else k

    def draft_limits(self, requests: list[Request]) -> dict[str, int]:
        """Adaptive K, for the proposer drafting after this step (`StepPlan.draft_limits`): the requests
        of `requests` that may verify fewer drafts than their K, by id, with that number."""
        if not self.config.adaptive_k:
            return {}
        limits = {}
        for request in requests:
            limit = self.draft_length(request)
            if limit < self.config.drafts_for(request.sampling_params):
                limits[request.request_id] = limit
        return limits
