"""The scheduler's record of what the model runner holds of each request, and the step plan's
request data written as deltas against it (core/step_plan.py says why deltas).

A request is sent in full the first time a plan schedules it; afterwards only the tokens appended
since, the table entries added (or the whole table once it was rewritten other than by appending, or
the request was preempted and resumed) and its computed count. A finished request's id reaches the
runner with the next plan that schedules anything, so that the runner drops it.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.step_cost import StepShape, chunk_pairs
from llmserve.core.step_plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.request import Request


@dataclass
class _SentState:
    """What the model runner holds of a request: the plans so far gave it this many tokens and
    table entries, and whether its table has changed since other than by appending."""

    num_tokens: int
    num_blocks: int
    table_rewritten: bool = False
    resumed: bool = False


class PlanWriter:
    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache = kv_cache_manager
        self._sent: dict[str, _SentState] = {}  # request id -> what the model runner holds of it
        self._finished_sent: list[str] = []  # finished requests the runner still holds

    def finished(self, request_id: str) -> None:
        """The request ended: the runner drops it with the next plan that runs anything."""
        if self._sent.pop(request_id, None) is not None:
            self._finished_sent.append(request_id)

    def preempted(self, request_id: str) -> None:
        """The request lost its place (and its KV, or its blocks' location): its table is new when it
        comes back."""
        sent = self._sent.get(request_id)
        if sent is not None:
            sent.resumed = True

    def write(self, plan: StepPlan, requests: list[Request]) -> tuple[int, StepShape]:
        """Fill the plan's request data for `requests` (scheduled, in plan order): in full for a
        request the runner does not hold, else what changed since the runner last saw it. Returns
        the step's prompt tokens (drafts and outputs are not) and its shape for the cost model."""
        kv = self.kv_cache
        for request_id in kv.take_rewritten_tables():
            sent = self._sent.get(request_id)
            if sent is not None:
                sent.table_rewritten = True
        num_prompt_tokens = decode_tokens = prefill_tokens = decode_context = prefill_pairs = 0
        for request in requests:
            request_id, table = request.request_id, kv.get_block_table(request.request_id)
            num_new, computed = plan.num_scheduled_tokens[request_id], request.num_computed_tokens
            num_prompt_tokens += max(0, min(computed + num_new, request.num_prompt_tokens) - computed)
            if request.num_tokens - computed <= 1:  # a decode row (its drafts included)
                decode_tokens += num_new
                decode_context += computed + num_new
            else:
                prefill_tokens += num_new
                prefill_pairs += chunk_pairs(num_new, computed)
            sent = self._sent.get(request_id)
            if sent is None:
                plan.new_requests.append(
                    NewRequestData(
                        request_id,
                        request.prompt_token_ids,
                        request.output_token_ids,
                        request.sampling_params,
                        request.eos_token_ids,
                        list(table),
                        request.num_computed_tokens,
                        request.pooling,
                    )
                )
                self._sent[request_id] = _SentState(request.num_tokens, len(table))
                continue
            replace = sent.table_rewritten or sent.resumed
            plan.cached_requests.append(
                CachedRequestData(
                    request_id,
                    request.all_token_ids[sent.num_tokens :],
                    list(table) if replace else table[sent.num_blocks :],
                    replace,
                    sent.resumed,
                    request.num_computed_tokens,
                )
            )
            sent.num_tokens, sent.num_blocks = request.num_tokens, len(table)
            sent.table_rewritten = sent.resumed = False
        if requests:  # finished requests reach the runner with the next step it runs
            plan.finished_request_ids, self._finished_sent = self._finished_sent, []
        return num_prompt_tokens, StepShape(decode_tokens, prefill_tokens, decode_context, prefill_pairs)
