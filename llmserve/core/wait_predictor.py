"""The one prediction of how long a new request waits before its first step, from measured rates.

wait = (prompt tokens queued ahead) x (seconds per token computed)
     + (requests ahead beyond the free running slots) x (seconds per finished request)
service = (its prompt's prefill) + (its max_tokens) x (seconds per step)

Both rates are measured over the engine's recent steps, in step time (idle time between bursts does not
dilute them). The prompt's prefill and the decode steps are the engine's step-time model's
(core/step_cost.py: the scheduler's, whose coefficients each step's stats carry here; nothing is fitted
in the server) once it is fitted, else its tokens x seconds per token and the recent seconds per step.
The engine's warm-up steps (engine/warmup.py) are the first of them (`prime`), so the first burst after
start-up is predicted too; until a request has finished there is no finish rate, and the admission
assumes the requests ahead are as long as the new one. The warm-up ran in the engine's process on idle
cores, while served steps share them with the server's HTTP and output handling: until a served
request has finished and `_SERVED_STEPS_TO_TRUST` served steps are measured (after each warm-up: an
engine restart primes again), the prior's predictions are taken `_COLD_START_MARGIN` times longer (a
429 with a Retry-After costs a client less than a 408 after waiting out its timeout). A burst's
admissions all happen before its first request finishes, so the margin holds for the whole burst.
The server's admission (entrypoints/openai/admission.py) refuses a request whose wait exceeds its
deadline.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from llmserve.core.step_cost import StepCost, StepShape
from llmserve.metrics.stats import StepStats
from llmserve.outputs import RequestOutput

_RECENT_STEPS = 256
_COLD_START_MARGIN = 2.0
_SERVED_STEPS_TO_TRUST = 32  # then the engine's decayed fit rests mostly on served steps


@dataclass(frozen=True)
class _Step:
    tokens: int  # prompt and generated tokens computed
    finished: int  # requests that finished
    seconds: float


class WaitPredictor:
    """Fed each step (`on_step`, an AsyncLLM step listener); `predict` needs no engine round trip."""

    def __init__(self, recent_steps: int = _RECENT_STEPS) -> None:
        self._steps: collections.deque[_Step] = collections.deque(maxlen=recent_steps)
        self._tokens = 0
        self._finished = 0
        self._seconds = 0.0
        self.step_cost: StepCost | None = None  # the engine's step-time model, as of its latest step
        self._primed = False
        self._served_steps = 0  # since the last warm-up
        self._served_finish = False  # a served request finished since the last warm-up

    def on_step(self, stats: StepStats | None, outputs: Sequence[RequestOutput]) -> None:
        if stats is None:  # an abort's output, not a step
            return
        self._served_steps += 1
        finished = sum(1 for output in outputs if output.finished)
        self._served_finish = self._served_finish or finished > 0
        self._add(stats, finished)

    def prime(self, steps: Sequence[StepStats]) -> None:
        """Take the engine's warm-up steps as measured ones (their requests' finishes do not count)."""
        if steps:  # a new engine's prior: the margin again until served steps replace it
            self._primed, self._served_steps, self._served_finish = True, 0, False
        for stats in steps:
            self._add(stats, 0)

    def _add(self, stats: StepStats, finished: int) -> None:
        step = _Step(stats.num_prompt_tokens + stats.num_generation_tokens, finished, stats.step_seconds)
        if len(self._steps) == self._steps.maxlen:
            self._drop(self._steps[0])
        self._steps.append(step)
        if stats.step_cost is not None:
            self.step_cost = StepCost(*stats.step_cost)
        self._tokens += step.tokens
        self._finished += step.finished
        self._seconds += step.seconds

    def _drop(self, step: _Step) -> None:
        self._tokens -= step.tokens
        self._finished -= step.finished
        self._seconds -= step.seconds

    @property
    def seconds_per_token(self) -> float | None:
        return self._seconds / self._tokens if self._tokens else None

    @property
    def seconds_per_step(self) -> float | None:
        return self._seconds / len(self._steps) if self._steps else None

    @property
    def seconds_per_finished_request(self) -> float | None:
        return self._seconds / self._finished if self._finished else None

    @property
    def margin(self) -> float:
        """What predictions are multiplied by: the cold start's margin while they rest on the warm-up."""
        cold = self._primed and (not self._served_finish or self._served_steps < _SERVED_STEPS_TO_TRUST)
        return _COLD_START_MARGIN if cold else 1.0

    def predict(self, queued_tokens: int, requests_over_slots: int = 0) -> float:
        """Seconds until a request arriving now is first scheduled; 0 before anything was measured."""
        wait = queued_tokens * (self.seconds_per_token or 0.0)
        if requests_over_slots > 0:
            wait += requests_over_slots * (self.seconds_per_finished_request or 0.0)
        return wait * self.margin

    def service(self, prompt_tokens: int, max_tokens: int, rows: int = 1) -> float:
        """Seconds a request takes once scheduled: its prefill, then a step per output token (at most
        max_tokens) in a batch of `rows` decodes like it (the cost model's step at that batch: a burst
        runs at the batch it makes, not at the recent steps' pace); 0 before anything was measured."""
        cost = self.step_cost
        if cost is None:
            per_token, per_step = self.seconds_per_token or 0.0, self.seconds_per_step or 0.0
            return (prompt_tokens * per_token + max_tokens * per_step) * self.margin
        context = rows * (prompt_tokens + max_tokens // 2)  # the decodes' KV, each halfway through
        decode_step = cost.predict(StepShape(rows, 0, context, 0))
        return (cost.chunk_seconds(prompt_tokens, 0) + max_tokens * decode_step) * self.margin
