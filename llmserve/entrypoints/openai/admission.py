"""Admission by deadline: refuse now (429 with a computed Retry-After) what could not start in time.

A request is refused when
  - the prompt tokens already queued plus its own would exceed `max_waiting_tokens`, or
  - its predicted queue wait (core/wait_predictor.py) exceeds `max_queue_delay`, or its predicted
    wait plus its own service time (prefill, max_tokens steps at the batch the requests in flight
    make with it) exceeds its `timeout`.
Retry-After is the predicted time until the request would be admitted if nothing else arrived. A request
admitted with a `timeout` is aborted (its KV blocks freed) when the timeout passes: serving.py's
EngineRequests arms the timer and answers 408.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from llmserve.core.wait_predictor import WaitPredictor
from llmserve.engine.async_llm import AsyncLLM


@dataclass(frozen=True)
class AdmissionConfig:
    max_waiting_tokens: int | None = None  # prompt tokens queued (sent, no output yet) before 429s
    max_queue_delay: float | None = None  # seconds of predicted queue wait before 429s


class Refused(Exception):
    """Why a request is refused, and when to retry (seconds, at least 1)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


class Admission:
    def __init__(self, engine: AsyncLLM, config: AdmissionConfig) -> None:
        self.engine = engine
        self.config = config
        self.predictor = WaitPredictor()
        engine.step_listeners.append(self.predictor.on_step)
        engine.add_warmup_listener(self.predictor.prime)

    def predicted_wait(self, in_flight: int, num_requests: int = 1, service: float = 0.0) -> float:
        """Seconds before `num_requests` arriving now, behind `in_flight` admitted requests (the
        server's count: the engine's gauges lag a burst), would be first scheduled. Before any request
        has finished (a cold start) the ones ahead are taken to have started together and to take
        `service` seconds each, as the new one: a running slot frees after one such service per
        round of `max_num_seqs`."""
        slots = self.engine.config.scheduler.max_num_seqs
        over_slots = in_flight + num_requests - slots
        wait = self.predictor.predict(self.engine.queued_prompt_tokens, over_slots)
        if over_slots > 0 and self.predictor.seconds_per_finished_request is None:
            wait += math.ceil(over_slots / slots) * service
        return wait

    def check(
        self, prompt_tokens: Sequence[int], timeout: float | None, in_flight: int = 0, max_tokens: int = 0
    ) -> None:
        """Raise Refused if these prompts should not be queued now."""
        queued, new = self.engine.queued_prompt_tokens, sum(prompt_tokens)
        bound = self.config.max_waiting_tokens
        if bound is not None and queued + new > bound:
            excess = queued + new - bound
            raise Refused(
                f"the server's waiting queue holds {queued} prompt tokens and admits at most {bound}; "
                "retry later",
                excess * (self.predictor.seconds_per_token or 0.0),
            )
        if timeout is None and self.config.max_queue_delay is None:
            return
        rows = min(in_flight + len(prompt_tokens), self.engine.config.scheduler.max_num_seqs)
        service = self.predictor.service(max(prompt_tokens, default=0), max_tokens, rows)
        wait = self.predicted_wait(in_flight, len(prompt_tokens), service)
        delay = self.config.max_queue_delay
        if delay is not None and wait > delay:
            raise Refused(
                f"the predicted queue wait of {wait:.1f} s exceeds the server's --max-queue-delay of "
                f"{delay:g} s; retry later",
                wait - delay,
            )
        if timeout is not None:
            total = wait + service
            if total > timeout:
                raise Refused(
                    f"the predicted time of {_seconds(total)} s (queue wait {wait:.1f} s) exceeds the "
                    f"request's timeout of {timeout:g} s; retry later",
                    wait if total - wait > timeout else total - timeout,  # never fits: retry when idle
                )


def _seconds(value: float) -> str:
    """Tenths of a second, or two significant digits below one second (a tiny model's 0.041 s)."""
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"
