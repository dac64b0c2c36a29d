"""Interactive requests under a batch flood: TTFT with priority scheduling versus FCFS.

A flood of long batch requests (priority 1) arrives at once; short interactive requests
(priority 0) arrive as a Poisson stream while it runs. The engine is driven in real time: each
request is added when its arrival instant passes, so queueing is real. The same timeline runs once
per scheduling policy; the figure of merit is the interactive requests' TTFT (p50, p99).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from llmserve.benchmarks.workload import BenchRequest, greedy_params


@dataclass(frozen=True)
class TimedRequest:
    arrival: float  # seconds after the start
    request: BenchRequest
    priority: int


def timeline(
    batch: list[BenchRequest], interactive: list[BenchRequest], rate: float, seed: int
) -> list[TimedRequest]:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=len(interactive))
    arrivals = np.cumsum(gaps)
    flood = [TimedRequest(0.0, r, 1) for r in batch]
    stream = [TimedRequest(float(t), r, 0) for t, r in zip(arrivals, interactive, strict=True)]
    return sorted(flood + stream, key=lambda item: item.arrival)


def run_timeline(engine, items: list[TimedRequest]) -> dict[int, list[float]]:
    """TTFT seconds per priority class, driving `engine` (an LLMEngine) in real time."""
    start, pending, ttft = time.monotonic(), list(items), {0: [], 1: []}
    priority_of = {}
    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        while pending and start + pending[0].arrival <= now:
            item = pending.pop(0)
            request_id = f"r{len(priority_of)}"
            priority_of[request_id] = item.priority
            engine.add_request(
                request_id,
                item.request.prompt_token_ids,
                greedy_params(item.request.max_tokens),
                arrival_time=start + item.arrival,
                priority=item.priority,
            )
        if not engine.has_unfinished_requests():
            time.sleep(min(0.005, max(0.0, start + pending[0].arrival - now)))
            continue
        for output in engine.step():
            if output.finished:
                ttft[priority_of[output.request_id]].append(output.metrics.time_to_first_token)
    return ttft


def summarize(ttft_seconds: list[float]) -> dict[str, float]:
    values = np.asarray(ttft_seconds) * 1e3
    return {
        "count": len(values),
        "p50_ms": float(np.percentile(values, 50)),
        "p99_ms": float(np.percentile(values, 99)),
    }
