"""The router's JSON rows carry each replica's own /v1/metrics summary, read from its /metrics."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.metrics.summary import Scrape, summary
from llmserve.router.index import PrefixIndex
from llmserve.router.metrics import RouterMetrics
from llmserve.router.replica import Replica
from tests.metrics.helpers import fed_metrics
from tests.router.test_routing_units import INFO


def test_rows_and_aggregate_have_the_servers_summary():
    metrics = fed_metrics()
    families = list(text_string_to_metric_families(metrics.render().decode()))
    replicas = [Replica("http://r0", INFO), Replica("http://r1", INFO), Replica("http://r2", INFO)]
    for replica, usage in zip(replicas, (0.2, 0.4, 0.9), strict=True):
        replica.metric_families, replica.kv_cache_usage = families, usage
        replica.num_running, replica.num_waiting = 2, 1  # as its health check reads them from /metrics
    replicas[2].healthy = False  # absent from the aggregate
    snapshot = RouterMetrics(replicas).snapshot(replicas, PrefixIndex([r.url for r in replicas], 1.0))
    own = summary(Scrape(metrics.registry.collect()))
    row = snapshot["replicas"][0]
    assert {key: row[key] for key in own if key != "kv_cache_usage_perc"} == {
        key: value for key, value in own.items() if key != "kv_cache_usage_perc"
    }
    aggregate = snapshot["aggregate"]
    assert aggregate["total_requests"] == 2 * own["total_requests"]
    assert aggregate["total_tokens"] == 2 * own["total_tokens"]
    assert aggregate["avg_latency_ms"] == pytest.approx(own["avg_latency_ms"])
    assert aggregate["kv_cache_usage_perc"] == pytest.approx(0.3)  # the healthy replicas' mean
    assert aggregate["replicas_healthy"] == 2
