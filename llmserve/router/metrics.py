"""The router's metrics: its own (`llmserve_router:*`: requests routed per replica and why, re-sends,
each replica's health, load and prefix-cache counters, the hit rate over all replicas) and every
series of every healthy replica's own /metrics with a `replica` label added (`llmserve:*`, ranks
included), so `sum(llmserve:prefix_cache_hits_total)` over the router's scrape is the deployment's.
`render` gives the Prometheus text, `snapshot` the same numbers as JSON (`GET /v1/metrics`): each
replica's row and the aggregate carry the summary a server's own `/v1/metrics` gives
(metrics/summary.py), computed from the replicas' /metrics as last read.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from llmserve.metrics.summary import Scrape, summary
from llmserve.router.index import PrefixIndex
from llmserve.router.replica import Replica


class RouterMetrics:
    """`llmserve_router:*` in a private registry; per-replica gauges are refreshed at scrape time."""

    def __init__(self, replicas: Sequence[Replica] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(ReplicaSeries(replicas))
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
        self.prefills = Counter(
            "llmserve_router:prefills",
            "Prompts sent to a prefill instance first (--prefill-replica), by instance and outcome: "
            "prefilled, or skipped (the decode instance computed it; replica empty when none was up).",
            ["replica", "outcome"],
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

    def on_prefill(self, url: str, prefilled: bool) -> None:
        self.prefills.labels(url, "prefilled" if prefilled else "skipped").inc()

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

    def snapshot(self, replicas: Sequence[Replica], index: PrefixIndex) -> dict:
        """The router's and its replicas' numbers, and their sums, as a JSON object."""
        routed = {r.url: {"prefix": 0.0, "load": 0.0} for r in replicas}
        for sample in self.routed.collect()[0].samples:
            if sample.name.endswith("_total"):
                routed[sample.labels["replica"]][sample.labels["reason"]] = sample.value
        rows = [
            _replica_row(replica, len(index.stored(replica.url)), routed[replica.url]) for replica in replicas
        ]
        totals = {
            name: sum(row[name] for row in rows)
            for name in (
                "num_requests_running",
                "num_requests_waiting",
                "prefix_cache_hits",
                "prefix_cache_queries",
            )
        }
        healthy = [r for r in replicas if r.healthy]
        totals = {**summary(merged_scrape(replicas)), **totals}  # the servers' summary, summed
        totals["kv_cache_usage_perc"] = (
            sum(r.kv_cache_usage for r in healthy) / len(healthy) if healthy else 0.0
        )  # a mean, not a sum: each replica has its own pool
        queries = totals["prefix_cache_queries"]
        totals["prefix_cache_hit_rate"] = totals["prefix_cache_hits"] / queries if queries else 0.0
        totals["replicas_healthy"] = sum(row["healthy"] for row in rows)
        return {
            "requests_resent": next(
                s.value for s in self.resent.collect()[0].samples if s.name.endswith("_total")
            ),
            "replicas": rows,
            "aggregate": totals,
        }


def merged_scrape(replicas: Sequence[Replica]) -> Scrape:
    """The healthy replicas' /metrics as last read, summed: the deployment's as one server's."""
    merged = Scrape()
    for replica in replicas:
        if replica.healthy:
            merged.add(replica.metric_families)
    return merged


def _replica_row(replica: Replica, indexed_blocks: int, routed: dict[str, float]) -> dict:
    return {
        **summary(Scrape(replica.metric_families)),  # the replica's own /v1/metrics, from its /metrics
        "replica": replica.url,
        "healthy": replica.healthy,
        "last_error": None if replica.healthy else replica.last_error,
        "requests_routed": routed,
        "in_flight": replica.in_flight,
        "num_requests_running": replica.num_running,
        "num_requests_waiting": replica.num_waiting,
        "kv_cache_usage_perc": replica.kv_cache_usage,
        "prefix_cache_hits": replica.prefix_cache_hits,
        "prefix_cache_queries": replica.prefix_cache_queries,
        "indexed_blocks": indexed_blocks,
    }


class ReplicaSeries(Collector):
    """Every series of each healthy replica's /metrics as last read, with a `replica` label added."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self.replicas = replicas

    def describe(self) -> list[Metric]:
        return []  # known only at scrape time

    def collect(self) -> list[Metric]:
        merged: dict[str, Metric] = {}
        for replica in self.replicas:
            if not replica.healthy:
                continue  # absent rather than stale: its counters come back with it
            for family in replica.metric_families:
                target = merged.get(family.name)
                if target is None:
                    target = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = target
                for sample in family.samples:
                    labels = {**sample.labels, "replica": replica.url}
                    target.add_sample(sample.name, labels, sample.value, sample.timestamp)
        return list(merged.values())
