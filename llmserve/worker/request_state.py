"""A request as the model runner holds it, kept up to date from each step plan's deltas.

It has the names of the scheduler's Request for what the runner reads (ids, tokens, computed count,
sampling parameters, drafts), so the sampler, the verifier and the proposers serve either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve.core.step_plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.sampling_params import SamplingParams
from llmserve.structured.matcher import GrammarState


@dataclass
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None  # seeded requests: the runner owns their random stream
    block_ids: list[int]
    num_computed_tokens: int
    num_resumptions: int = 0  # times it came back from a preemption
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified this step
    spec_token_probs: torch.Tensor | None = None  # their q ([k, V]); None: greedy or one-hot
    spec_tree_parents: list[int] | None = None  # a token tree's parents (sample/token_tree.py); None: a chain
    # the q of the last proposal drafted for it, kept here for the step that verifies some of them
    draft_probs: torch.Tensor | None = None
    pooling: bool = False  # an embedding request: pooled instead of sampled
    grammar: GrammarState | None = None  # structured outputs: its matcher, made when it first samples

    @classmethod
    def from_new(cls, data: NewRequestData, device: torch.device) -> CachedRequestState:
        seed = data.sampling_params.seed
        generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
        return cls(
            request_id=data.request_id,
            prompt_token_ids=data.prompt_token_ids,
            all_token_ids=data.prompt_token_ids + data.output_token_ids,
            sampling_params=data.sampling_params,
            eos_token_ids=data.eos_token_ids,
            generator=generator,
            block_ids=list(data.block_ids),
            num_computed_tokens=data.num_computed_tokens,
            pooling=data.pooling,
        )

    def update(self, data: CachedRequestData) -> None:
        self.all_token_ids.extend(data.new_token_ids)
        if data.replace_blocks:
            self.block_ids = list(data.block_ids)
        else:
            self.block_ids.extend(data.block_ids)
        self.num_resumptions += data.resumed
        self.num_computed_tokens = data.num_computed_tokens

    def set_drafts(self, token_ids: list[int], tree_parents: list[int] | None = None) -> None:
        """The drafts the plan has it verify: a prefix of its last proposal, whose q the runner kept;
        `tree_parents` where they are a token tree."""
        self.spec_token_ids = token_ids
        self.spec_tree_parents = tree_parents
        probs = self.draft_probs
        self.spec_token_probs = None if probs is None or not token_ids else probs[: len(token_ids)]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)


def apply_plan(requests: dict[str, CachedRequestState], plan: StepPlan, device: torch.device) -> None:
    """Bring a runner's requests up to date with a step plan: drop the finished ones, add the new
    ones, apply the others' deltas, and set the drafts each verifies this step."""
    for request_id in plan.finished_request_ids:
        requests.pop(request_id, None)
    for new in plan.new_requests:
        requests[new.request_id] = CachedRequestState.from_new(new, device)
    for cached in plan.cached_requests:
        requests[cached.request_id].update(cached)
    drafts, trees = plan.spec_token_ids, plan.spec_tree_parents
    for request_id in plan.num_scheduled_tokens:
        requests[request_id].set_drafts(drafts.get(request_id, []), trees.get(request_id))
