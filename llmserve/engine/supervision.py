"""When the engine process dies: how often and how soon it is started again.

The engine-process client (core_client.py) restarts a dead engine process (spawned: the server has
threads by then, and a fork would copy them half-held) while `RestartPolicy.delay` gives a delay;
once the retries are spent, or with no policy (`--no-engine-restart`), the server is told the engine
is gone for good and exits non-zero, for an orchestrator that restarts pods.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # restarts within `window_seconds` before the server gives up and exits
    backoff_seconds: float = 1.0  # the delay before the first restart; doubled for each one after
    max_backoff_seconds: float = 30.0  # the longest delay
    window_seconds: float = 600.0  # restarts older than this no longer count against max_restarts


@dataclass
class RestartBudget:
    """The restarts done recently, and the delay before the next one (None: give up)."""

    policy: RestartPolicy
    _times: list[float] = field(default_factory=list)

    def next_delay(self, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        self._times = [t for t in self._times if now - t < self.policy.window_seconds]
        if len(self._times) >= self.policy.max_restarts:
            return None
        delay = self.policy.backoff_seconds * 2 ** len(self._times)
        self._times.append(now)
        return min(delay, self.policy.max_backoff_seconds)
