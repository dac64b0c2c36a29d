"""A real server's JSON /v1/metrics and its /metrics under both names, after a known workload."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.conftest import API_KEY
from tests.entrypoints.test_server_lifecycle import MODEL, wait_idle

pytestmark = pytest.mark.server


def summary(server) -> dict:
    response = httpx.get(f"{server.base_url}/v1/metrics", headers=server.headers, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def test_v1_metrics_needs_the_key_like_every_v1_route(server):
    assert httpx.get(f"{server.base_url}/v1/metrics", timeout=10).status_code == 401


def test_json_summary_counts_what_the_client_was_told(server):
    wait_idle(server)
    before = summary(server)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    no_eos = {"ignore_eos": True}
    usages = [
        client.completions.create(model=MODEL, prompt="one two three", max_tokens=5, extra_body=no_eos).usage,
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, extra_body=no_eos
        ).usage,
    ]
    wait_idle(server)
    after = summary(server)
    assert after["model"] == MODEL
    assert after["total_requests"] - before["total_requests"] == 2
    assert after["total_prompt_tokens"] - before["total_prompt_tokens"] == sum(
        u.prompt_tokens for u in usages
    )
    assert after["total_generation_tokens"] - before["total_generation_tokens"] == 5 + 2 * 4
    assert after["total_tokens"] - before["total_tokens"] == sum(u.total_tokens for u in usages)
    assert after["avg_latency_ms"] > 0 and after["avg_tokens_per_second"] > 0 and after["avg_batch_size"] >= 1
    assert (after["num_requests_running"], after["num_requests_waiting"], after["kv_cache_usage_perc"]) == (
        0,
        0,
        0,
    )


def test_prometheus_series_under_both_names_with_the_model_name(server):
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    assert all(s.labels["model_name"] == MODEL for s in samples if s.name.startswith(("llmserve:", "vllm:")))
    by_name = {s.name: s.value for s in samples if not s.labels.keys() - {"model_name"}}
    for name in ("generation_tokens_total", "request_params_n_count", "request_prompt_tokens_sum"):
        assert by_name["vllm:" + name] == by_name["llmserve:" + name] > 0, name


def test_dashboard_stats_are_the_same_summary(server):
    stats = httpx.get(f"{server.base_url}/dashboard/stats", timeout=10).json()
    assert stats["model"] == MODEL
    assert stats["summary"]["total_requests"] == summary(server)["total_requests"]
    assert isinstance(stats["points"], list)
