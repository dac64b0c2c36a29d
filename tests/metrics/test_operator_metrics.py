"""The operators' metrics and the JSON summary, exact on hand-made steps."""

from __future__ import annotations

import pytest

from llmserve.engine.step_stats import accepted_per_position
from llmserve.metrics.history import MetricsHistory
from llmserve.metrics.summary import Scrape, bucket_delta, quantile, summary, window
from tests.metrics.helpers import fed_metrics


def sample(metrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value("llmserve:" + name, labels)
    assert value is not None, name
    return value


def test_preemptions_by_mode_and_swapped_blocks():
    metrics = fed_metrics()
    assert sample(metrics, "num_preemptions_total") == 2
    assert sample(metrics, "num_preemptions_by_mode_total", mode="swap") == 1
    assert sample(metrics, "num_preemptions_by_mode_total", mode="recompute") == 1
    assert sample(metrics, "swapped_out_blocks_total") == 4
    assert sample(metrics, "swapped_in_blocks_total") == 4
    assert sample(metrics, "num_requests_swapped") == 1
    assert sample(metrics, "cpu_cache_usage_perc") == 0.5


def test_request_length_tpot_and_parameter_histograms():
    metrics = fed_metrics()
    assert sample(metrics, "request_prompt_tokens_sum") == 5 + 2
    assert sample(metrics, "request_generation_tokens_sum") == (3 + 1) + 2  # a's two samples, then b
    assert sample(metrics, "request_max_num_generation_tokens_sum") == 3 + 2
    # decode time 1.0 s each; a's longest sample has 2 tokens after its first, b's 1
    assert sample(metrics, "request_time_per_output_token_seconds_sum") == pytest.approx(1.0 / 2 + 1.0 / 1)
    assert sample(metrics, "request_time_per_output_token_seconds_count") == 2
    assert sample(metrics, "request_inference_time_seconds_sum") == pytest.approx(2 * 1.2)
    assert sample(metrics, "request_params_n_sum") == 2 + 1
    assert sample(metrics, "request_params_max_tokens_sum") == 3 + 8
    assert sample(metrics, "request_params_n_bucket", le="1.0") == 1


def test_tokens_and_latencies_per_lora_adapter():
    """Only b ran under an adapter (sql): its prompt and tokens and its latencies, by lora_name."""
    metrics = fed_metrics()
    assert sample(metrics, "lora_prompt_tokens_total", lora_name="sql") == 2
    assert sample(metrics, "lora_generation_tokens_total", lora_name="sql") == 2
    assert sample(metrics, "lora_time_to_first_token_seconds_sum", lora_name="sql") == pytest.approx(0.3)
    assert sample(metrics, "lora_e2e_request_latency_seconds_sum", lora_name="sql") == pytest.approx(1.3)
    assert sample(metrics, "lora_e2e_request_latency_seconds_count", lora_name="sql") == 1
    assert metrics.registry.get_sample_value("llmserve:lora_prompt_tokens_total", {"lora_name": "a"}) is None
    assert not metrics._adapters  # b finished: nothing kept


def test_speculative_acceptance_per_position():
    assert accepted_per_position([]) == ()
    assert accepted_per_position([0, 0]) == ()
    assert accepted_per_position([2, 0, 3]) == (2, 2, 1)  # leading runs: a=2 counts at 0 and 1
    metrics = fed_metrics()
    assert sample(metrics, "spec_decode_num_drafts_total") == 2
    assert sample(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position="0") == 1
    assert sample(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position="1") == 1


def test_summary_is_computed_from_the_exported_families():
    result = summary(Scrape(fed_metrics().registry.collect()))
    assert result["total_requests"] == 2
    assert result["total_prompt_tokens"] == 7 and result["total_generation_tokens"] == 6
    assert result["total_tokens"] == 13
    assert result["avg_latency_ms"] == pytest.approx(1300)
    assert result["avg_tokens_per_second"] == pytest.approx(6 / 2.6)
    assert result["avg_batch_size"] == pytest.approx((2 + 2 + 1) / 3)
    assert result["num_requests_running"] == 2 and result["num_requests_waiting"] == 1
    assert result["kv_cache_usage_perc"] == 0.25
    assert result["spec_decode_acceptance_rate"] == pytest.approx(2 / 5)
    assert result["num_preemptions"] == 2
    assert result["finished_by_reason"] == {"stop": 1, "length": 2}


def test_the_router_reads_the_same_summary_from_a_scrape():
    from prometheus_client.parser import text_string_to_metric_families

    metrics = fed_metrics()
    parsed = Scrape(text_string_to_metric_families(metrics.render().decode()))
    assert summary(parsed) == summary(Scrape(metrics.registry.collect()))


def test_quantile_interpolates_within_buckets_as_prometheus_does():
    buckets = [(0.1, 0.0), (0.2, 10.0), (0.4, 20.0), (float("inf"), 20.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.2)
    assert quantile(0.25, buckets) == pytest.approx(0.15)
    assert quantile(0.75, buckets) == pytest.approx(0.3)
    assert quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None
    assert bucket_delta({1.0: 2.0}, {1.0: 5.0, 2.0: 7.0}) == [(1.0, 3.0), (2.0, 7.0)]


def test_window_rates_and_history():
    metrics = fed_metrics()
    before, after = Scrape(), Scrape(metrics.registry.collect())
    point = window(before, after, seconds=2.0)
    assert point["generation_tokens_per_second"] == 3.0
    assert point["prompt_tokens_per_second"] == 3.5
    assert point["ttft_p50_ms"] == pytest.approx(375)  # both at 0.3 s, in (0.25, 0.5]: its midpoint
    assert point["prefix_cache_hit_rate"] is None  # no lookups in the window
    clock = iter([0.0, 0.5, 1.0, 1.0, 2.0, 2.0])
    history = MetricsHistory(lambda: Scrape(metrics.registry.collect()), clock=lambda: next(clock))
    history.sample()  # t=0
    history.sample()  # t=0.5: too soon, not kept
    assert len(history.points()) == 1  # t=1 kept; one point, between t=0 and t=1
    assert [p["t"] for p in history.points()] == [-1.0, 0.0]


def test_a_server_exporting_only_vllm_names_gives_the_same_summary():
    from prometheus_client.parser import text_string_to_metric_families

    metrics = fed_metrics(metric_names="vllm")
    parsed = Scrape(text_string_to_metric_families(metrics.render().decode()))
    assert summary(parsed) == summary(Scrape(metrics.registry.collect()))
