"""The CI-sized soak run: a few hundred mixed requests against the tiny model, every gate but the RSS
slope (which needs 3,000 requests after warm-up: `llmserve bench soak` at full size)."""

from __future__ import annotations

import pytest

from llmserve.benchmarks.soak import SoakConfig, rss_slope, run_soak
from llmserve.cli.launch import find_tcmalloc
from tests.entrypoints.conftest import free_port


def test_rss_slope_is_the_least_squares_slope_per_1k_requests():
    samples = [(n, 100.0 + 0.002 * n) for n in range(100, 4000, 100)]
    assert abs(rss_slope(samples, after=0) - 2.0) < 1e-9
    assert rss_slope(samples[:10], after=0) is None  # under 3,000 requests: no slope


@pytest.mark.server
def test_ci_sized_soak_passes_its_gates(tiny_model_dir, tmp_path):
    config = SoakConfig(num_requests=240, concurrency=8, max_tokens=40, warmup_requests=0)
    # 128 KiB of float32 KV for the tiny model (512 bytes a token): 8 blocks of 32 tokens, fewer than
    # 8 requests in flight need, so the scheduler preempts
    server_args = ["--dtype", "float32", "--kv-cache-memory", "128KiB", "--max-model-len", "256"]
    report = run_soak(tiny_model_dir, server_args, config, tmp_path / "server.log", free_port())
    assert sum(report.requests.values()) == 240
    assert report.failures(config) == [], (
        report.failures(config),
        (tmp_path / "server.log").read_text()[-3000:],
    )
    assert report.greedy_checked > 20 and report.disconnects > 40 and report.bad_requests_4xx > 0
    assert report.invariant_violations == 0 and report.rss_mb and report.preemptions > 0
    assert len(report.server_rss_mb) == len(report.rss_mb)
    # the server runs as users run it: on tcmalloc wherever the console script would preload it
    assert report.allocator == ("tcmalloc" if find_tcmalloc() else "system")
    print(report.requests, "preemptions:", report.preemptions)


def test_an_in_band_error_is_an_error_event_not_a_text_that_says_error():
    from llmserve.benchmarks.soak import _in_band_error

    text = '{"id":"c","object":"text_completion","choices":[{"index":0,"text":"error","finish_reason":null}]}'
    assert not _in_band_error(f"data: {text}")
    assert _in_band_error('data: {"error": {"message": "boom", "type": "server_error"}}')
    assert not _in_band_error("data: [DONE]") and not _in_band_error("")
