"""A server's prefix-cache hit counters as its Prometheus /metrics gives them, before and after a run.

The counters are the engine's own (`llmserve:prefix_cache_queries_total` and `_hits_total`: prompt
tokens looked up when a request is first scheduled, and of those the tokens found cached; vLLM's
`vllm:` names read the same). A router's /metrics carries each replica's with a `replica` label, so
one scrape of the router gives every replica's and their sum: the deployment's hit rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

_PREFIXES = ("llmserve:", "vllm:")


@dataclass(frozen=True)
class PrefixCacheCounters:
    by_replica: dict[str, tuple[float, float]]  # replica label ("" for a single engine) -> (queries, hits)

    def minus(self, before: PrefixCacheCounters) -> PrefixCacheCounters:
        """The counts between `before` and this scrape, replica by replica."""
        return PrefixCacheCounters(
            {
                replica: (
                    queries - before.by_replica.get(replica, (0.0, 0.0))[0],
                    hits - before.by_replica.get(replica, (0.0, 0.0))[1],
                )  # fmt: skip
                for replica, (queries, hits) in self.by_replica.items()
            }
        )

    def to_json(self) -> dict:
        queries = sum(q for q, _ in self.by_replica.values())
        hits = sum(h for _, h in self.by_replica.values())
        return {
            "queries": queries,
            "hits": hits,
            "hit_rate": hits / queries if queries else None,
            "by_replica": {
                replica: {"queries": q, "hits": h, "hit_rate": h / q if q else None}
                for replica, (q, h) in sorted(self.by_replica.items())
            },
        }


def parse_prefix_cache_counters(text: str) -> PrefixCacheCounters | None:
    """The counters in a Prometheus exposition, per `replica` label; None if it has none."""
    by_prefix: dict[str, dict[str, list[float]]] = {prefix: {} for prefix in _PREFIXES}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for prefix, found in by_prefix.items():
                for slot, name in enumerate(("prefix_cache_queries_total", "prefix_cache_hits_total")):
                    if sample.name == prefix + name:
                        found.setdefault(sample.labels.get("replica", ""), [0.0, 0.0])[slot] += sample.value
    # llmserve exports each series under both prefixes: read one (llmserve:, else a vLLM server's vllm:)
    found = next((found for found in by_prefix.values() if found), {})
    return PrefixCacheCounters({k: (v[0], v[1]) for k, v in found.items()}) if found else None


def read_prefix_cache_counters(url: str) -> PrefixCacheCounters | None:
    """The server's counters now; None if it has no /metrics or no such counters."""
    try:
        response = httpx.get(f"{url}/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    return parse_prefix_cache_counters(response.text) if response.status_code == 200 else None
