"""Timing shared by the micro-benchmark tools."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `repeats` calls, after one untimed call that pays first-use costs
    (oneDNN's primitive build, the allocator's growth)."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
