"""Turns engine requests into user-facing outputs: detokenization, stop strings, n > 1 grouping.

A user request with n > 1 becomes n engine requests (children) that share nothing but the prompt;
this module folds their progress back into one RequestOutput with n completions.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmserve.request import Request, RequestStatus


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self.child_index: dict[str, tuple[str, int]] = {}  # child request id -> (parent id, index)

    def add_request(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, child.sampling_params)
            for child in children
        ]
        self.parents[request_id] = _ParentState(
            request_id, prompt, children[0].prompt_token_ids, children, detokenizers
        )
        for index, child in enumerate(children):
            self.child_index[child.request_id] = (request_id, index)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents

    def children_of(self, request_id: str) -> list[Request]:
        state = self.parents.get(request_id)
        return [] if state is None else list(state.children)

    def process(
        self, updated: list[Request], logprobs: dict[str, dict[int, float]], finish_request
    ) -> list[RequestOutput]:
        """Fold this step's new tokens into outputs; `finish_request(req, status)` ends a stop-string hit."""
        touched: dict[str, _ParentState] = {}
        for request in updated:
            parent_id, index = self.child_index[request.request_id]
            state = self.parents[parent_id]
            self._record_logprobs(request, logprobs.get(request.request_id))
            stop = state.detokenizers[index].update([request.all_token_ids[-1]])
            if stop is not None and not request.is_finished:
                request.stop_reason = stop
                finish_request(request, RequestStatus.FINISHED_STOPPED)
            touched[parent_id] = state
        return [self._make_output(state) for state in touched.values()]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Final output of an aborted request (its children are already finished by the scheduler)."""
        state = self.parents.get(request_id)
        return None if state is None else self._make_output(state)

    def outputs_for(self, requests: list[Request]) -> list[RequestOutput]:
        """Outputs of requests that changed state without a new token (ended by the scheduler)."""
        parents = {self.child_index[r.request_id][0] for r in requests if r.request_id in self.child_index}
        return [self._make_output(self.parents[parent]) for parent in parents]

    @staticmethod
    def _record_logprobs(request: Request, entry: dict[int, float] | None) -> None:
        if request.logprobs is None or entry is None:
            return
        request.logprobs.append(entry)
        request.cumulative_logprob += entry[request.all_token_ids[-1]]

    def _make_output(self, state: _ParentState) -> RequestOutput:
        completions = [
            self._completion(index, child, detok)
            for index, (child, detok) in enumerate(zip(state.children, state.detokenizers, strict=True))
        ]
        finished = all(child.is_finished for child in state.children)
        if finished:
            self._forget(state)
        first = state.children[0]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens or 0,
            metrics=RequestMetrics(
                arrival_time=first.arrival_time,
                first_scheduled_time=first.first_scheduled_time,
                first_token_time=min(
                    (c.first_token_time for c in state.children if c.first_token_time), default=None
                ),
                finished_time=max((c.finished_time or 0.0) for c in state.children) if finished else None,
                num_preemptions=sum(c.num_preemptions for c in state.children),
            ),
        )

    @staticmethod
    def _completion(index: int, child: Request, detok: IncrementalDetokenizer) -> CompletionOutput:
        finished = child.is_finished
        return CompletionOutput(
            index=index,
            text=detok.get_text(finished),
            token_ids=child.output_token_ids,
            finish_reason=child.status.finish_reason,
            stop_reason=child.stop_reason,
            logprobs=None if child.logprobs is None else list(child.logprobs),
            cumulative_logprob=None if child.logprobs is None else child.cumulative_logprob,
        )

    def _forget(self, state: _ParentState) -> None:
        del self.parents[state.request_id]
        for child in state.children:
            del self.child_index[child.request_id]
