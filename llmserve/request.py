"""A request as the engine sees it: tokens, how many are computed, and where it stands."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmserve.outputs import PromptLogprobs, SpecDecodeStats
from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass
class DraftProposal:
    """Speculative decoding: drafts a proposer (spec_decode/proposer.py) left after a step, to follow the
    request's first `num_tokens` tokens, for the scheduler to take some of at the next step; and the q
    they were drawn from ([k, V]; None when the request is greedy or the q is one-hot, as for n-gram
    drafts). A token tree (sample/token_tree.py) has `parents`: each draft's parent index (-1: the
    request's last token), parents first; None is a chain. Tree drafts carry no q (fixed candidates)."""

    num_tokens: int
    token_ids: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None


# Adaptive K: the weight of the latest verify pass in a request's moving average of accepted drafts; a
# half follows a change in the text (a quoted span ends, another starts) within two or three steps.
ACCEPTANCE_AVERAGE_WEIGHT = 0.5


@dataclass
class DraftAcceptance:
    """Speculative decoding, adaptive K: a moving average of the drafts a request's verify passes
    accepted, and how many drafts are worth proposing for it from there."""

    mean_accepted: float | None = None  # None before its first verify pass

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """A verify pass of `num_drafts` drafts accepted the leading `num_accepted`. Where it accepted
        all of them one more counts, as the next draft might have been right too: K grows back."""
        value = num_accepted + (num_accepted == num_drafts)
        mean = self.mean_accepted
        self.mean_accepted = value if mean is None else mean + ACCEPTANCE_AVERAGE_WEIGHT * (value - mean)

    def limit(self, k: int) -> int:
        """Drafts to propose at most, of the request's `k`: one more than the drafts it accepts on
        average, and at least one (a request that stopped accepting keeps measuring); `k` before its
        first verify pass."""
        if self.mean_accepted is None or k <= 0:
            return k
        return min(k, int(self.mean_accepted + 0.5) + 1)


class Request:
    """One sequence being generated.

    There are no prefill or decode phases: `num_computed_tokens` counts the tokens whose KV is in the
    cache, `num_tokens` the tokens known (prompt + output). Each step the scheduler lets the request
    catch up by some of the difference; when it has caught up, the model samples its next token.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        lora_key: bytes = b"",
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.eos_token_ids = () if sampling_params.ignore_eos else eos_token_ids
        # LoRA: its adapter's digest, mixed into its first block's prefix-cache hash (b"": the base model)
        self.lora_key = lora_key
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache on admission
        self.fork_source: Request | None = None  # sibling whose prompt KV this parallel sample shares
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # prompt_logprobs: what the model runner returned so far, chunk by chunk of the prompt
        self.prompt_logprobs: PromptLogprobs | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # Speculative decoding (llmserve/spec_decode): drafts to verify in the step being planned (empty
        # otherwise; never part of all_token_ids), the proposal made after the last step, and the
        # drafts and accepted tokens so far, and their moving average (adaptive K).
        self.spec_token_ids: list[int] = []
        self.spec_tree_parents: list[int] | None = None  # a token tree's parents (None: a chain)
        self.draft_proposal: DraftProposal | None = None
        self.spec_decode_stats = SpecDecodeStats()
        self.draft_acceptance = DraftAcceptance()
        self.pooling = False  # an embedding request: prefill only, finished once its prompt is computed

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt log-probs are still to be computed: its prompt must not come from the prefix
        cache, whose positions the model does not run."""
        if self.sampling_params.prompt_logprobs is None:
            return False
        done = self.prompt_logprobs
        return done is None or done.end_position < self.num_prompt_tokens - 1

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        if self.prompt_logprobs is None:
            self.prompt_logprobs = chunk
        else:
            self.prompt_logprobs.extend(chunk)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def clear_drafts(self) -> None:
        """Speculative decoding: nothing to verify (drafts checked, rolled back, or void)."""
        self.spec_token_ids = []
        self.spec_tree_parents = None

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first `num_output_tokens` (speculative decoding: a stop string hit
        before the last of the step's new tokens)."""
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
