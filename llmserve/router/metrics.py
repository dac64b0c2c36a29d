"""The router's Prometheus metrics (`llmserve_router:*`, a private registry): requests routed per
replica and why, re-sends, and each replica's health, load and prefix-cache counters as the router
last read them, plus the hit rate over all replicas; the replica gauges are set at scrape time."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from llmserve.router.index import PrefixIndex
from llmserve.router.replica import Replica


class RouterMetrics:
    """`llmserve_router:*` in a private registry; per-replica gauges are refreshed at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.routed = Counter(
            "llmserve_router:requests_routed",
            "Requests sent to a replica, by replica and reason.",
            ["replica", "reason"],
            registry=self.registry,
        )
        self.matched_blocks = Counter(
            "llmserve_router:matched_blocks",
            "Prompt blocks the chosen replica held, by the index.",
            ["replica"],
            registry=self.registry,
        )
        self.resent = Counter(
            "llmserve_router:requests_resent",
            "Requests re-sent to another replica before any output reached the client.",
            registry=self.registry,
        )
        self.prefix_cache_hit_rate = Gauge(
            "llmserve_router:prefix_cache_hit_rate",
            "Prefix-cache hits / queries (tokens) over all replicas, from their /metrics.",
            registry=self.registry,
        )
        self.replica_gauges = {
            name: Gauge(f"llmserve_router:replica_{name}", doc, ["replica"], registry=self.registry)
            for name, doc in (
                ("healthy", "1 if the replica answers its health check."),
                ("in_flight", "Requests this router has in the replica."),
                ("num_requests_waiting", "The replica's waiting requests, from its /metrics."),
                ("kv_cache_usage_perc", "The replica's KV-cache usage, from its /metrics."),
                ("prefix_cache_hits", "The replica's prefix-cache hits (tokens), from its /metrics."),
                ("prefix_cache_queries", "The replica's prefix-cache queries (tokens), from its /metrics."),
                ("indexed_blocks", "Block hashes the router's index holds for the replica."),
            )
        }

    def on_routed(self, replica: Replica, matched_blocks: int, by_prefix: bool, resent: bool) -> None:
        self.routed.labels(replica.url, "prefix" if by_prefix else "load").inc()
        self.matched_blocks.labels(replica.url).inc(matched_blocks)
        if resent:
            self.resent.inc()

    def render(self, replicas: Sequence[Replica], index: PrefixIndex) -> bytes:
        queries = sum(replica.prefix_cache_queries for replica in replicas)
        hits = sum(replica.prefix_cache_hits for replica in replicas)
        self.prefix_cache_hit_rate.set(hits / queries if queries else 0.0)
        for replica in replicas:
            values = {
                "healthy": float(replica.healthy),
                "in_flight": replica.in_flight,
                "num_requests_waiting": replica.num_waiting,
                "kv_cache_usage_perc": replica.kv_cache_usage,
                "prefix_cache_hits": replica.prefix_cache_hits,
                "prefix_cache_queries": replica.prefix_cache_queries,
                "indexed_blocks": len(index.stored(replica.url)),
            }
            for name, value in values.items():
                self.replica_gauges[name].labels(replica.url).set(value)
        return generate_latest(self.registry)
