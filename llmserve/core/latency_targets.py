"""Latency targets in the scheduler: each step's time budget for prompt chunks, and prompts' slack.

Every request has a TTFT and a TPOT target (its own `ttft_target_ms` / `tpot_target_ms`, else the
server's `--ttft-target-ms` / `--tpot-target-ms`; none where both are unset). With the step-time cost
model (core/step_cost.py) the scheduler plans each step so that:

  - the step's predicted time stays within the TPOT slack of every decoding request in it. A request's
    TPOT is measured over its whole output: expected to produce H tokens (its max_tokens, or fewer:
    the typical length of the requests finished so far, and at least g + 1 once it has g), the first
    at time f, it meets its target if its last token comes by f + TPOT x (H - 1). After this step its
    other H - g - 1 tokens take a predicted decode step each; the time left is this step's slack (never
    less than one TPOT target: a request behind its target is not held to a step shorter than the
    target). Before any request has finished H is the request's max_tokens, the one expectation
    there is (g + 1 there held the first requests' prompts to one TPOT a step, one after another).
    Decodes always run; prompt chunks get what is left of the smallest slack after the decodes'
    predicted time, sized by the model (none where that is under MIN_CAPPED_CHUNK tokens);
  - a prompt's first token is planned by half its TTFT target (the rest is a margin for the cost
    model's errors and for bursts); a prompt whose TTFT slack (that planned time - now - its predicted
    prefill time) is under one step, or already spent, gets its whole chunk at once whatever the
    decodes' slack: prompts are delayed, never starved. And while the prompts, served one after
    another at full speed in the order below, each in a step beside the running decodes, would not all
    meet their planned times (a backlog: a burst, or more load than the machine sustains), no chunk is
    capped: the TPOT cap only spends slack the TTFT targets can spare;
  - waiting prompts are taken in order of TTFT deadline (the planned first token) within each
    priority level (a run of equal priority in the queue's order, which ages them), requests that
    have already produced tokens (preempted) first. Earliest deadline first keeps the latest first
    token as early as any order can on one machine; least slack first (the deadline less each
    prompt's own prefill) would put a long prompt ahead of a short one that came a little earlier,
    which then waits for it;
  - a step may give several prompts their first tokens, as far as the slack allows: holding every
    further prompt back a step (one first token per step, unless cheaper than the decodes) cost
    goodput and both tails at 1.5 req/s (docs/scheduling.md).

Until the cost model is fitted (its first steps) nothing is capped and the order is FCFS.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass

from llmserve.core.step_cost import StepCostModel, StepShape
from llmserve.request import Request

# The scheduler plans each first token by this share of its TTFT target: the rest is a margin for the
# cost model's errors and for bursts, which would otherwise turn deferred prompts into misses.
PLANNED_TTFT_SHARE = 0.5
# The smallest capped prompt chunk worth a step with prefill in it: a step with a few prompt tokens
# costs far more than the cost model's c2 x n (measured: docs/scheduling.md, step 2).
MIN_CAPPED_CHUNK = 128


@dataclass(frozen=True)
class LatencyTargets:
    """The server's targets in seconds; None: no target."""

    ttft: float | None = 1.0
    tpot: float | None = 0.05

    @classmethod
    def from_ms(cls, ttft_ms: float | None, tpot_ms: float | None) -> LatencyTargets:
        return cls(_seconds(ttft_ms), _seconds(tpot_ms))

    def ttft_of(self, request: Request) -> float | None:
        own = request.sampling_params.ttft_target_ms
        return self.ttft if own is None else own / 1e3

    def tpot_of(self, request: Request) -> float | None:
        own = request.sampling_params.tpot_target_ms
        return self.tpot if own is None else own / 1e3


def _seconds(ms: float | None) -> float | None:
    return None if not ms else ms / 1e3  # 0 turns a target off


class OutputLengths:
    """The typical output length of finished requests (an exponential moving average): how many tokens
    a decoding request's TPOT is expected to be measured over."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self.typical: float | None = None  # None until a request finishes

    def add(self, num_tokens: int) -> None:
        self.typical = (
            num_tokens if self.typical is None else self.typical + self.weight * (num_tokens - self.typical)
        )


class StepBudget:
    """One step's time for prompt chunks: the smallest TPOT slack among the running decodes, less the
    decodes' predicted time. `seconds_left` is None when nothing caps prompts (no decode with a
    target, or the cost model not fitted yet). `waiting_order` is the order waiting requests are
    admitted in; `rush` is set when some prompt (running or waiting, served in that order at full speed
    after this step) would miss its TTFT target: then no prompt chunk is capped."""

    def __init__(
        self,
        model: StepCostModel,
        targets: LatencyTargets,
        running: Sequence[Request],
        waiting: Sequence[Request] = (),
        by_priority: bool = False,
        in_flight: Set[str] = frozenset(),
        now: float | None = None,
        typical_output: float | None = None,
    ) -> None:
        self.model, self.targets = model, targets
        self.now = time.monotonic() if now is None else now
        rows = context = 0
        prompts = []
        ends = []  # per decoding request with a TPOT target: (its last token's deadline, steps to it, TPOT)
        for request in running:
            if request.request_id in in_flight:
                continue
            if request.first_token_time is None:
                prompts.append(request)
                continue
            rows += 1
            context += request.num_tokens
            tpot = targets.tpot_of(request)
            if tpot is not None:
                done = request.num_output_tokens
                limit = request.sampling_params.max_tokens
                horizon = max(done + 1, limit if typical_output is None else min(limit, int(typical_output)))
                ends.append((request.first_token_time + tpot * (horizon - 1), horizon - done, tpot))
        predicted = model.predict(StepShape(rows, 0, context, 0))
        self.step_seconds = predicted or 0.0  # the decodes' predicted step
        # this step may take what leaves each request's remaining steps, at the predicted pace, within
        # its TPOT over the tokens it is expected to produce
        slack = min(
            (max(tpot, end - self.now - (steps - 1) * self.step_seconds) for end, steps, tpot in ends),
            default=math.inf,
        )
        self.seconds_left = None if predicted is None or math.isinf(slack) else slack - predicted
        fitted = predicted is not None
        self.waiting_order = self._order(waiting, by_priority) if fitted else list(waiting)
        self.rush = self.seconds_left is not None and self._backlog_misses(prompts + self.waiting_order)

    def ttft_slack(self, request: Request, num_computed: int | None = None) -> float:
        """Seconds to spare before the request's planned first token, after its predicted prefill from
        `num_computed` tokens (default: its computed ones); -inf for a request that has produced
        tokens (its first token is behind it: it catches up first), inf without a target."""
        deadline = self.ttft_deadline(request)
        if math.isinf(deadline):
            return deadline
        computed = request.num_computed_tokens if num_computed is None else num_computed
        return deadline - self.now - self.model.chunk_seconds(request.num_tokens - computed, computed)

    def prompt_chunk(self, request: Request, num_new: int, num_computed: int) -> int:
        """How many of `num_new` prompt tokens, after `num_computed`, the request computes this step
        (0: none); their predicted time is charged to the budget."""
        if self.seconds_left is None:
            return num_new
        urgent = self.rush or self.ttft_slack(request, num_computed) < self.step_seconds
        if not urgent:
            bound = self.model.max_chunk(self.seconds_left, num_computed)  # what the slack allows
            if bound is not None and bound < num_new:
                # a sliver of a prompt costs a mixed step's overhead for little prefill: none at all
                num_new = bound if bound >= MIN_CAPPED_CHUNK else 0
        if num_new:
            self.seconds_left -= self.model.chunk_seconds(num_new, num_computed)
        return num_new

    def _backlog_misses(self, prompts: Iterable[Request]) -> bool:
        """Whether serving the prompts in turn at full speed, from this step on, misses a TTFT target
        (earliest-deadline feasibility: each waits for the prefill of those before it, and each takes
        a step of its own beside the running decodes, as the slack need not let them share one)."""
        elapsed = 0.0
        for request in prompts:
            deadline = self.ttft_deadline(request)
            if deadline == -math.inf:
                continue  # a resumed request: no TTFT left to meet
            computed = request.num_computed_tokens
            elapsed += self.step_seconds + self.model.chunk_seconds(request.num_tokens - computed, computed)
            if deadline - self.now < elapsed:
                return True
        return False

    def ttft_deadline(self, request: Request) -> float:
        """When the request's first token is planned (arrival + PLANNED_TTFT_SHARE x its TTFT target);
        -inf for a request that has produced tokens (it catches up first), inf without a target."""
        if request.first_token_time is not None or request.num_output_tokens:
            return -math.inf
        ttft = self.targets.ttft_of(request)
        return math.inf if ttft is None else request.arrival_time + PLANNED_TTFT_SHARE * ttft

    def _order(self, waiting: Iterable[Request], by_priority: bool) -> list[Request]:
        """The waiting requests (in the queue's order) with each run of one priority level sorted by
        TTFT deadline (stable: ties keep the queue's order). `by_priority`: levels are `priority`
        values, else one level holds all. Runs keep their place, so the queue's aging still
        interleaves them."""
        ordered: list[Request] = []
        run: list[Request] = []
        for request in waiting:
            if run and by_priority and request.priority != run[0].priority:
                ordered += sorted(run, key=self.ttft_deadline)
                run = []
            run.append(request)
        return ordered + sorted(run, key=self.ttft_deadline)
