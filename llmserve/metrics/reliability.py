"""Counters of the server's failures and recoveries on /metrics, read from EngineHealth at scrape time:
`llmserve:engine_stalls_total`, `llmserve:engine_restarts_total`, `llmserve:invariant_violations_total`."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

PREFIX = "llmserve:"


class ReliabilityCollector(Collector):
    """Counters whose values live elsewhere (the engine's health): name -> (documentation, read)."""

    def __init__(self, counters: dict[str, tuple[str, Callable[[], float]]]) -> None:
        self._counters = counters

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(PREFIX + name, doc) for name, (doc, _) in self._counters.items()]

    def collect(self) -> list[CounterMetricFamily]:
        return [
            CounterMetricFamily(PREFIX + name, doc, value=read())
            for name, (doc, read) in self._counters.items()
        ]


def health_counters(engine) -> ReliabilityCollector:
    """The engine's health counters (engine/health.py:EngineHealth) and its invariant checks'."""
    health = engine.health
    return ReliabilityCollector(
        {
            "invariant_violations": (
                "--check-invariants: KV cache and block pool integrity checks that failed after a step.",
                lambda: engine.gauges.invariant_violations,
            ),
            "engine_stalls": (
                "Times the watchdog found requests in flight and no engine step finished in time.",
                lambda: health.num_stalls,
            ),
            "engine_restarts": (
                "Engine processes started again after one died.",
                lambda: health.num_restarts,
            ),
        }
    )
