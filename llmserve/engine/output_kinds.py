"""Delta outputs turned into what each request asked for (its `SamplingParams.output_kind`).

The engine produces deltas; a DELTA request gets them as they are, a FINAL_ONLY request one output
with everything when it finishes, a CUMULATIVE request everything so far after every step. Applied
once, by the front end that took the request: the offline engine's output processor
(output_processor.py), or the server (async_llm.py), whose engine process applies none and sends
deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmserve.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from llmserve.sampling_params import RequestOutputKind


@dataclass
class _Completion:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # pieces, joined when an output is made
    logprobs: list[dict[int, float]] | None = None
    last: CompletionOutput | None = None  # finish and stop reasons, cumulative log-prob

    def add(self, delta: CompletionOutput) -> None:
        self.token_ids += delta.token_ids
        if delta.text:
            self.text.append(delta.text)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.logprobs
        self.last = delta

    def output(self, index: int) -> CompletionOutput:
        last = self.last
        return CompletionOutput(
            index=index,
            text="".join(self.text),
            token_ids=list(self.token_ids),
            finish_reason=None if last is None else last.finish_reason,
            stop_reason=None if last is None else last.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            cumulative_logprob=None if last is None else last.cumulative_logprob,
        )


class OutputAccumulator:
    def __init__(self) -> None:
        self._kinds: dict[str, RequestOutputKind] = {}
        self._held: dict[str, dict[int, _Completion]] = {}  # CUMULATIVE and FINAL_ONLY requests
        self._prompt_logprobs: dict[str, PromptLogprobs] = {}  # held from the first delta

    def add_request(self, request_id: str, kind: RequestOutputKind) -> None:
        self._kinds[request_id] = kind
        if kind is not RequestOutputKind.DELTA:
            self._held[request_id] = {}

    def forget(self, request_id: str) -> None:
        self._kinds.pop(request_id, None)
        self._held.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)

    def apply(self, delta: RequestOutput) -> RequestOutput | None:
        """The output to hand the caller for this delta, or None (FINAL_ONLY before the end)."""
        request_id = delta.request_id
        kind = self._kinds.get(request_id, RequestOutputKind.DELTA)
        held = self._held.get(request_id)
        if held is not None and delta.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = delta.prompt_logprobs
        prompt_logprobs = self._prompt_logprobs.get(request_id)
        if delta.finished:
            self.forget(request_id)
        if kind is RequestOutputKind.DELTA or held is None:
            return delta
        for completion in delta.outputs:
            held.setdefault(completion.index, _Completion()).add(completion)
        if kind is RequestOutputKind.FINAL_ONLY and not delta.finished:
            return None
        outputs = [held[index].output(index) for index in sorted(held)]
        return replace(delta, outputs=outputs, prompt_logprobs=prompt_logprobs)
