"""The step plan: what the scheduler sends the model runner each step, by request id and as deltas.

A runner holds the state of every request it has seen (worker/request_state.py) until the plan says
the request finished, so a plan carries a request in full only the first time it is scheduled
(`NewRequestData`) and afterwards only what changed (`CachedRequestData`): the tokens appended
since, the blocks added to its table (or the whole table where it was rewritten: a resumed
preemption, a copy on write, a sliding window's freed blocks, rolled-back drafts) and its computed
count. The plan holds plain data only (no Request objects, no tensors), so it can cross a process
boundary as it is; the q of sampled drafts stays with the runner that drafted them.
"""

from __future__ import annotations

import msgspec

from llmserve.core.kv_tiers import TierOp
from llmserve.core.kv_transfer import KVExport
from llmserve.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    """A request the runner has not seen (or has dropped): everything it needs to run it."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # none for a new request
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]  # the stop tokens its min_tokens masks (none with ignore_eos)
    block_ids: list[int]
    num_computed_tokens: int
    pooling: bool = False  # an embedding request: its last prompt token's hidden state, no sampling


class CachedRequestData(msgspec.Struct, array_like=True, gc=False):
    """What changed for a request the runner holds, since the runner last saw it."""

    request_id: str
    new_token_ids: list[int]
    block_ids: list[int]  # appended to its block table, or the whole table when `replace_blocks`
    replace_blocks: bool
    resumed: bool  # preempted since: its KV was freed or moved (a draft model's KV with it)
    num_computed_tokens: int


class StepPlan(msgspec.Struct, array_like=True, gc=False):
    new_requests: list[NewRequestData] = msgspec.field(default_factory=list)
    cached_requests: list[CachedRequestData] = msgspec.field(default_factory=list)
    # request id -> tokens it catches up by this step (its drafts included), in the scheduler's order
    num_scheduled_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    # speculative decoding: request id -> the drafts it verifies this step
    spec_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    finished_request_ids: list[str] = msgspec.field(default_factory=list)  # the runner drops them
    swap_out: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (device, swap) block copies
    swap_in: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (swap, device) block copies
    block_copies: list[tuple[int, int]] = msgspec.field(default_factory=list)  # copy-on-write (src, dst)
    tier_ops: list[TierOp] = msgspec.field(default_factory=list)  # RAM / disk tier copies, in order
    # a prefill instance: full prompt blocks to send after the forward (core/kv_transfer.py)
    kv_exports: list[KVExport] = msgspec.field(default_factory=list)
    # speculative decoding: whether to draft after this step, and auto mode's cap on drafts per request
    speculate: bool = False
    max_drafts: int | None = None
    # adaptive K: request id -> drafts to propose after this step at most, where fewer than its K
    draft_limits: dict[str, int] = msgspec.field(default_factory=dict)
    # token trees (sample/token_tree.py): request id -> its drafts' parents, for those verifying a tree
    spec_tree_parents: dict[str, list[int]] = msgspec.field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())
