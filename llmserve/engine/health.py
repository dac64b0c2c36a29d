"""The server's health: one state the engine's client and the server report into, and the watchdog.

States (what /health says; only `ready` answers 200):
  starting    the engine process is loading the model (answered by the server's start-up responder,
              entrypoints/openai/startup_responder.py, before the app runs)
  warming     loaded; the engine runs its warm-up requests (engine/warmup.py), then says it is ready
  ready       serving
  stalled     requests are in flight and no step has finished within the watchdog's limit
  restarting  the engine process (or one of its workers) died; a new one is loading
  stopping    the server is shutting down, or the engine is gone for good

The watchdog judges progress, not time alone: a step may take up to `factor` times the predicted time
of the largest step the scheduler can plan, and never less than `min_seconds`; so a long prefill is not
a hang. The prediction is the engine's step-time model's (core/step_cost.py, whose coefficients each
step's stats carry) for a prefill chunk of the scheduler's whole token budget, or the slowest recent
step if that is longer (a chunk deep into a long prompt; or the only measure while the model is not
fitted: its first steps, and pipeline parallelism, whose overlapping steps it does not fit). The
warm-up's measured steps are the first recent steps; until a step has been measured (a restart without
warm-up, `--no-warmup`: kernels build and pages fault in during the first steps) the limit is
`warmup_seconds`.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmserve.core.step_cost import StepCost, StepShape, chunk_pairs
from llmserve.metrics.stats import StepStats

logger = logging.getLogger("llmserve")


class HealthState(enum.Enum):
    STARTING = "starting"
    WARMING = "warming"
    READY = "ready"
    STALLED = "stalled"
    RESTARTING = "restarting"
    STOPPING = "stopping"

    @property
    def serving(self) -> bool:
        """The engine takes requests and the watchdog judges its progress."""
        return self is HealthState.READY


@dataclass(frozen=True)
class WatchdogConfig:
    min_seconds: float = 30.0  # the shortest time without a finished step that counts as a stall
    factor: float = 20.0  # the limit is this many times the predicted time of the largest step
    warmup_seconds: float = 300.0  # the limit before a step has been measured (kernels build in the first)
    poll_seconds: float = 0.5  # how often the watchdog looks


_RECENT_STEPS = 64  # the steps whose slowest bounds the prediction from below


class EngineHealth:
    """The state behind /health, with the step-progress facts the watchdog judges it by.

    The engine's reader thread reports steps (`on_step`) and the supervisor reports restarts; the
    watchdog thread (`start_watchdog`) calls `check` every `poll_seconds`.
    """

    def __init__(self, watchdog: WatchdogConfig = WatchdogConfig(), max_step_tokens: int = 2048) -> None:
        self.watchdog = watchdog
        self.max_step_tokens = max_step_tokens
        self.num_stalls = 0  # stalls detected since start-up (a Prometheus counter reads it)
        self.num_restarts = 0  # engine restarts since start-up
        self.on_stall: list[Callable[[], None]] = []
        self._state = HealthState.STARTING
        self._reason = "the engine is loading the model"
        self._last_progress = time.monotonic()
        self._steps: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=_RECENT_STEPS
        )  # tokens, s
        self._cost: StepCost | None = None  # the engine's step-time model, as of its latest step
        self._lock = threading.Lock()
        self._stop = threading.Event()

    # -- what reports into it -------------------------------------------------------------------

    @property
    def state(self) -> HealthState:
        return self._state

    @property
    def reason(self) -> str:
        return self._reason

    def set(self, state: HealthState, reason: str = "") -> None:
        with self._lock:
            if self._state is HealthState.STOPPING and state is not HealthState.STOPPING:
                return  # stopping is final
            if state is HealthState.WARMING:
                self._forget_speed()  # a new engine: its speed is measured afresh
            self._state, self._reason = state, reason
            self._last_progress = time.monotonic()

    def on_warmed_up(self, steps: list[StepStats]) -> None:
        """A new engine is ready: its warm-up's measured steps (none without one) are the first speeds."""
        with self._lock:
            self._forget_speed()  # the previous engine's speeds predict nothing of this one
            for stats in steps:
                self._measured(stats)
        self.set(HealthState.READY)

    def _forget_speed(self) -> None:
        self._steps.clear()
        self._cost = None

    def _measured(self, stats: StepStats) -> None:
        """A step's time, and the engine's model after it (held by the caller)."""
        self._steps.append(
            (max(1, stats.num_prompt_tokens + stats.num_generation_tokens), stats.step_seconds)
        )
        if stats.step_cost is not None:
            self._cost = StepCost(*stats.step_cost)

    def on_step(self, stats: StepStats | None) -> None:
        """A step finished (the engine's reader thread): progress, and its speed for the prediction."""
        now = time.monotonic()
        with self._lock:
            self._last_progress = now
            tokens = 0 if stats is None else stats.num_prompt_tokens + stats.num_generation_tokens
            if tokens and self._state is not HealthState.WARMING:  # a first step builds kernels: no speed
                self._measured(stats)
            if self._state in (HealthState.WARMING, HealthState.STALLED):
                if self._state is HealthState.STALLED:
                    logger.warning("the engine is making progress again after a stall")
                self._state, self._reason = HealthState.READY, ""

    # -- the watchdog ---------------------------------------------------------------------------

    def step_limit(self) -> float:
        """Seconds without a finished step, while requests are in flight, that count as a stall."""
        if self._state is HealthState.WARMING or not self._steps:
            return max(self.watchdog.warmup_seconds, self.watchdog.min_seconds)
        return max(self.watchdog.min_seconds, self.watchdog.factor * self.predicted_max_step_seconds())

    def predicted_max_step_seconds(self) -> float:
        """The engine's model's time of a `max_step_tokens` prefill chunk; until the engine has fitted
        one (and always under pipeline parallelism, whose overlapping batches it does not fit), the
        largest recent step's time scaled to that many tokens; never less than the slowest recent step
        (held by the caller)."""
        slowest = max(seconds for _, seconds in self._steps)
        tokens = self.max_step_tokens
        if self._cost is None:
            largest_tokens, largest_seconds = max(self._steps)
            return max(largest_seconds / largest_tokens * tokens, slowest)
        return max(self._cost.predict(StepShape(0, tokens, 0, chunk_pairs(tokens, 0))), slowest)

    def check(self, busy: bool, now: float | None = None) -> bool:
        """Turn `stalled` if `busy` and no step finished within the limit; True when it just did."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not busy:
                self._last_progress = now  # idle time is not a stall
                return False
            if not self._state.serving:
                return False
            waited, limit = now - self._last_progress, self.step_limit()
            if waited <= limit:
                return False
            self._state = HealthState.STALLED
            self._reason = (
                f"requests are in flight but no engine step has finished for {waited:.1f} s "
                f"(limit {limit:.1f} s)"
            )
            self.num_stalls += 1
        logger.error("engine stalled: %s", self._reason)
        for listener in self.on_stall:
            listener()
        return True

    def start_watchdog(self, busy: Callable[[], bool]) -> threading.Thread:
        """A daemon thread that calls `check(busy())` every `poll_seconds` until `stop_watchdog`."""

        def run() -> None:
            while not self._stop.wait(self.watchdog.poll_seconds):
                self.check(busy())

        thread = threading.Thread(target=run, name="llmserve-engine-watchdog", daemon=True)
        thread.start()
        return thread

    def stop_watchdog(self) -> None:
        self._stop.set()
