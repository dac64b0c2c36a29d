"""The recent past of the metrics for the dashboard: scrapes of the registry kept at most one per
`interval` seconds, taken only when someone asks (no background work while nobody watches), each
point a window over the last few of them (summary.py:window).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from llmserve.metrics.summary import Scrape, window

MAX_POINTS = 300
INTERVAL_SECONDS = 1.0
WINDOW_SCRAPES = 5  # percentiles and rates over ~5 s: a 1 s window holds too few requests


class MetricsHistory:
    def __init__(
        self,
        scrape: Callable[[], Scrape],
        interval: float = INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scrape = scrape
        self.interval = interval
        self.clock = clock
        self.scrapes: deque[tuple[float, Scrape]] = deque(maxlen=MAX_POINTS + WINDOW_SCRAPES)

    def sample(self) -> None:
        """Take a scrape unless the last one is younger than the interval."""
        now = self.clock()
        if not self.scrapes or now - self.scrapes[-1][0] >= self.interval:
            self.scrapes.append((now, self.scrape()))

    def points(self) -> list[dict]:
        """One point per scrape after the first, each over up to `WINDOW_SCRAPES` scrapes before it;
        `t` is seconds before now (negative)."""
        self.sample()
        scrapes, now = list(self.scrapes), self.clock()
        points = []
        for i in range(1, len(scrapes)):
            (t0, before), (t1, after) = scrapes[max(0, i - WINDOW_SCRAPES)], scrapes[i]
            points.append({"t": t1 - now, **window(before, after, t1 - t0)})
        return points[-MAX_POINTS:]
