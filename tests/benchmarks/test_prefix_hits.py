"""Prefix-cache counters read from a Prometheus exposition: one engine's, a router's per replica."""

from __future__ import annotations

import pytest

from llmserve.benchmarks.prefix_hits import parse_prefix_cache_counters

ENGINE = """# TYPE llmserve:prefix_cache_queries counter
llmserve:prefix_cache_queries_total 1000.0
llmserve:prefix_cache_queries_created 1.7e9
# TYPE llmserve:prefix_cache_hits counter
llmserve:prefix_cache_hits_total 600.0
"""
ROUTER = """# TYPE llmserve:prefix_cache_queries counter
llmserve:prefix_cache_queries_total{replica="http://a"} 100.0
llmserve:prefix_cache_queries_total{replica="http://b"} 300.0
# TYPE llmserve:prefix_cache_hits counter
llmserve:prefix_cache_hits_total{replica="http://a"} 50.0
llmserve:prefix_cache_hits_total{replica="http://b"} 250.0
# TYPE llmserve_router:requests_resent counter
llmserve_router:requests_resent_total 2.0
"""


def test_one_engine():
    counters = parse_prefix_cache_counters(ENGINE)
    assert counters.by_replica == {"": (1000.0, 600.0)}
    assert counters.to_json()["hit_rate"] == 0.6


def test_a_router_sums_its_replicas_and_a_run_is_the_difference_of_two_scrapes():
    before = parse_prefix_cache_counters(ROUTER)
    after = parse_prefix_cache_counters(ROUTER.replace("300.0", "500.0").replace("250.0", "420.0"))
    run = after.minus(before).to_json()
    assert (run["queries"], run["hits"]) == (200.0, 170.0)
    assert run["by_replica"]["http://a"] == {"queries": 0.0, "hits": 0.0, "hit_rate": None}
    assert run["by_replica"]["http://b"]["hit_rate"] == pytest.approx(0.85)
    assert parse_prefix_cache_counters(ROUTER).to_json()["hit_rate"] == pytest.approx(300 / 400)


def test_vllm_names_and_a_server_without_them():
    assert parse_prefix_cache_counters(ENGINE.replace("llmserve:", "vllm:")).by_replica == {
        "": (1000.0, 600.0)
    }
    assert parse_prefix_cache_counters("# TYPE x gauge\nx 1.0\n") is None
