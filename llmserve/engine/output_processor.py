"""Turns engine requests into user-facing outputs: detokenization, stop strings, n > 1 grouping.

A user request with n > 1 becomes n engine requests (children) that share nothing but the prompt;
this module folds their progress back into one RequestOutput. It makes deltas
(`RequestOutputKind.DELTA`): each holds, per completion that changed, only its new tokens, text and
log-probs. Where this engine is the front end that took the requests (the offline API) its outputs
are then of the kind each request asked for (output_kinds.py), here and nowhere else; in the engine
process (`apply_output_kinds=False`) they stay deltas, since they cross to the server as deltas and
the server, the front end there, applies the kind (async_llm.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.output_kinds import OutputAccumulator
from llmserve.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput, SpecDecodeStats
from llmserve.request import Request, RequestStatus
from llmserve.sampling_params import RequestOutputKind

logger = logging.getLogger("llmserve")


@dataclass
class _Sent:
    """How much of one child's completion earlier outputs carried."""

    num_tokens: int = 0
    text_len: int = 0
    finished: bool = False


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    num_detokenized: list[int]  # output tokens of each child fed to its detokenizer so far
    sent: list[_Sent]
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer, apply_output_kinds: bool = True) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self.child_index: dict[str, tuple[str, int]] = {}  # child request id -> (parent id, index)
        self.failed: list[str] = []  # requests whose processing raised, until the engine takes them
        self.output_kinds = OutputAccumulator() if apply_output_kinds else None  # None: deltas only

    def add_request(
        self, request_id: str, prompt: str | None, children: list[Request], kind: RequestOutputKind
    ) -> None:
        """Track a request's children; its outputs will be of `kind` (deltas without output kinds)."""
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, child.sampling_params)
            for child in children
        ]
        self.parents[request_id] = _ParentState(
            request_id,
            prompt,
            children[0].prompt_token_ids,
            children,
            detokenizers,
            [0] * len(children),
            [_Sent() for _ in children],
        )
        for index, child in enumerate(children):
            self.child_index[child.request_id] = (request_id, index)
        if self.output_kinds is not None:
            self.output_kinds.add_request(request_id, kind)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents

    def children_of(self, request_id: str) -> list[Request]:
        state = self.parents.get(request_id)
        return [] if state is None else list(state.children)

    def add_prompt_logprobs(self, chunks: dict[str, PromptLogprobs]) -> None:
        """Keep a step's prompt log-probs on their requests until the first output carries them."""
        for request_id, chunk in chunks.items():
            parent_id, index = self.child_index.get(request_id, (None, 0))
            if parent_id is not None and index == 0:  # parallel samples share the prompt: one copy
                self.parents[parent_id].children[0].add_prompt_logprobs(chunk)

    def process(
        self, updated: list[Request], logprobs: dict[str, list[dict[int, float]]], finish_request
    ) -> list[RequestOutput]:
        """Fold this step's new tokens into outputs; `finish_request(req, status)` ends a stop-string hit.

        A request can bring several new tokens (speculative decoding): they are detokenized one at a
        time, so a stop string ends the output at the token completing it, as without speculation.
        """
        touched: dict[str, _ParentState] = {}
        for request in updated:
            parent_id, index = self.child_index[request.request_id]
            if parent_id in self.failed:
                continue
            state = self.parents[parent_id]
            try:
                stop, dropped = self._detokenize_new_tokens(
                    request, state, index, logprobs.get(request.request_id)
                )
                if stop is not None and (dropped or not request.is_finished):
                    self._finish_at_stop_string(request, stop, finish_request)
            except Exception:  # one request's text, stop strings or logprobs: it alone fails
                logger.exception("processing the output of request %s failed", parent_id)
                self.failed.append(parent_id)
                touched.pop(parent_id, None)
                continue
            touched[parent_id] = state
        return self._of_kind([self._make_output(state) for state in touched.values()])

    def take_failed(self) -> list[str]:
        """Requests whose output processing raised since the last call (the engine aborts them)."""
        failed, self.failed = self.failed, []
        return failed

    def _detokenize_new_tokens(
        self, request: Request, state: _ParentState, index: int, entries: list[dict[int, float]] | None
    ) -> tuple[str | None, bool]:
        """Feed the child's new tokens (and log-probs) in order; returns the stop string hit, if any,
        and whether tokens after it were dropped."""
        first = state.num_detokenized[index]
        new_ids = request.all_token_ids[request.num_prompt_tokens + first :]
        for offset, token_id in enumerate(new_ids):
            self._record_logprobs(request, token_id, entries[offset] if entries else None)
            stop = state.detokenizers[index].update([token_id])
            if stop is not None:
                request.truncate_output(first + offset + 1)
                state.num_detokenized[index] = first + offset + 1
                return stop, offset + 1 < len(new_ids)
        state.num_detokenized[index] = first + len(new_ids)
        return None, False

    @staticmethod
    def _finish_at_stop_string(request: Request, stop: str, finish_request) -> None:
        request.stop_reason = stop
        if request.is_finished:  # speculative decoding: a token after the stop string had ended it
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            finish_request(request, RequestStatus.FINISHED_STOPPED)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Final output of an aborted request (its children are already finished by the scheduler);
        None for a request this processor does not hold."""
        state = self.parents.get(request_id)
        if state is None:
            self._forget_kind(request_id)
            return None
        outputs = self._of_kind([self._make_output(state)])
        return outputs[0] if outputs else None

    def outputs_for(self, requests: list[Request]) -> list[RequestOutput]:
        """Outputs of requests that changed state without a new token (ended by the scheduler)."""
        parents = {self.child_index[r.request_id][0] for r in requests if r.request_id in self.child_index}
        return self._of_kind([self._make_output(self.parents[parent]) for parent in parents])

    def _of_kind(self, deltas: list[RequestOutput]) -> list[RequestOutput]:
        """The deltas as the outputs their requests asked for (FINAL_ONLY: none before the end)."""
        kinds = self.output_kinds
        if kinds is None:
            return deltas
        return [output for output in map(kinds.apply, deltas) if output is not None]

    def _forget_kind(self, request_id: str) -> None:
        if self.output_kinds is not None:
            self.output_kinds.forget(request_id)

    @staticmethod
    def _record_logprobs(request: Request, token_id: int, entry: dict[int, float] | None) -> None:
        if request.logprobs is None or entry is None:
            return
        request.logprobs.append(entry)
        request.cumulative_logprob += entry[token_id]

    def _make_output(self, state: _ParentState) -> RequestOutput:
        completions = [
            completion
            for index, child in enumerate(state.children)
            if (completion := self._new_part(index, child, state)) is not None
        ]
        finished = all(child.is_finished for child in state.children)
        if finished:
            self._forget(state)
        first = state.children[0]
        prompt_logprobs = None
        if not state.prompt_logprobs_sent and completions:  # with the first output, complete by then
            prompt_logprobs, state.prompt_logprobs_sent = first.prompt_logprobs, True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens or 0,
            spec_decode=_spec_decode_stats(state.children),
            prompt_logprobs=prompt_logprobs,
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
    def _new_part(index: int, child: Request, state: _ParentState) -> CompletionOutput | None:
        """What child `index` gained since the last output, None if nothing: tokens and their log-probs,
        text (a tail that may still become a stop string is held back), and its finish once."""
        sent = state.sent[index]
        finished = child.is_finished
        text = state.detokenizers[index].get_text(finished)[sent.text_len :]
        token_ids = child.output_token_ids[sent.num_tokens :]
        if not token_ids and not text and (not finished or sent.finished):
            return None
        logprobs = None if child.logprobs is None else child.logprobs[sent.num_tokens :]
        sent.num_tokens += len(token_ids)
        sent.text_len += len(text)
        sent.finished = finished
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            finish_reason=child.status.finish_reason,
            stop_reason=child.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=None if child.logprobs is None else child.cumulative_logprob,
        )

    def forget(self, request_id: str) -> None:
        """Drop a request the engine gave up on (no final output)."""
        state = self.parents.get(request_id)
        if state is not None:
            self._forget(state)
        self._forget_kind(request_id)

    def _forget(self, state: _ParentState) -> None:
        del self.parents[state.request_id]
        for child in state.children:
            del self.child_index[child.request_id]


def _spec_decode_stats(children: list[Request]) -> SpecDecodeStats | None:
    """Drafts and accepted tokens summed over the samples; None when nothing was drafted."""
    total = sum((c.spec_decode_stats for c in children), SpecDecodeStats())
    return total if total.num_drafts else None
