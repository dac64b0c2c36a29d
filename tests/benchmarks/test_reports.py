"""Report arithmetic on known inputs: throughput ratios, percentiles, TPOT, goodput, SSE parsing."""

import asyncio
import json
import math

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmserve.benchmarks.naive_batching import NaiveBatchStats
from llmserve.benchmarks.serve import (
    Distribution,
    RequestResult,
    StreamTracker,
    arrival_offsets,
    completion_payload,
    drawn_rate,
    send_request,
    summarize,
)
from llmserve.benchmarks.serve import format_report as serve_report
from llmserve.benchmarks.throughput import (
    ThroughputResult,
    check_fits,
    count_matching,
    format_report,
    naive_result,
    speedup,
)
from llmserve.benchmarks.workload import BenchRequest


def test_throughput_rates_and_speedup_over_the_best_naive_batch_size():
    continuous = ThroughputResult("continuous", 10, prompt_tokens=1000, output_tokens=500, seconds=2.0)
    assert continuous.output_tok_s == 250 and continuous.total_tok_s == 750
    naive_8 = ThroughputResult("naive(B=8)", 10, 1000, 500, seconds=10.0, matching_outputs=10)
    naive_16 = ThroughputResult("naive(B=16)", 10, 1000, 500, seconds=5.0, matching_outputs=9)
    ratio, best = speedup(continuous, [naive_8, naive_16])
    assert best is naive_16 and ratio == pytest.approx(2.5)
    report = format_report(continuous, [naive_8, naive_16])
    assert "2.50x" in report and "naive(B=16)" in report and "matching_outputs" in report
    assert naive_16.matching_share == 0.9 and naive_16.to_json()["matching_share"] == 0.9
    assert "matching_share" in report and continuous.matching_share is None


def test_naive_result_counts_padding_and_waiting_rows_as_computed():
    stats = NaiveBatchStats(num_requests=3, num_groups=1, prompt_tokens=12, prefill_tokens=18,
                            output_tokens=9, decode_tokens=12)  # fmt: skip
    result = naive_result(3, stats, seconds=3.0)
    assert (result.system, result.requests, result.computed_tokens) == ("naive(B=3)", 3, 30)
    assert result.output_tok_s == 3 and result.total_tok_s == 7


def test_outputs_compared_token_by_token_and_overlong_requests_refused():
    assert count_matching([[1, 2], [3]], [[1, 2], [4]]) == 1
    check_fits([BenchRequest("", [1] * 10, 6)], max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len=15"):
        check_fits([BenchRequest("", [1] * 10, 6)], max_model_len=15)


def test_distribution_percentiles_in_milliseconds():
    dist = Distribution.of([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert dist.mean == pytest.approx(50.5)
    assert (dist.p50, dist.p90, dist.p99) == pytest.approx((50.5, 90.1, 99.01))
    assert Distribution.of([]) is None


def test_tpot_excludes_the_first_token():
    assert RequestResult(ok=True, output_tokens=11, ttft=0.1, e2e=0.6).tpot == pytest.approx(0.05)
    assert RequestResult(ok=True, output_tokens=1, ttft=0.1, e2e=0.1).tpot is None


def test_summary_throughput_goodput_and_slo_attainment():
    ok = dict(ok=True, prompt_tokens=10)
    results = [
        RequestResult(**ok, output_tokens=11, ttft=0.1, e2e=0.6, itls=[0.05] * 10),  # meets both
        RequestResult(**ok, output_tokens=11, ttft=0.5, e2e=1.0, itls=[0.05] * 10),  # TTFT too slow
        RequestResult(**ok, output_tokens=5, ttft=0.2, e2e=1.0, itls=[0.2] * 4),  # TPOT 200 ms too slow
        RequestResult(**ok, output_tokens=1, ttft=0.2, e2e=0.2),  # meets: one token has no TPOT
        RequestResult(error="HTTP 500"),
    ]
    metrics = summarize(results, duration=2.0, goodput={"ttft": 300, "tpot": 100})
    assert (metrics.num_requests, metrics.num_ok) == (5, 4)
    assert metrics.request_throughput == 2.0
    assert metrics.output_throughput == pytest.approx(28 / 2)
    assert metrics.total_token_throughput == pytest.approx((40 + 28) / 2)
    assert metrics.request_goodput == pytest.approx(1.0) and metrics.slo_attainment == pytest.approx(0.4)
    assert metrics.latency_ms["ttft"].p50 == pytest.approx(200)
    assert metrics.latency_ms["tpot"].mean == pytest.approx((50 + 50 + 200) / 3)
    assert metrics.latency_ms["itl"].mean == pytest.approx(1e3 * (20 * 0.05 + 4 * 0.2) / 24)
    assert metrics.errors == ["HTTP 500"]
    assert [r["ttft_ms"] for r in metrics.per_request] == [100, 500, 200, 200, None]  # workload order
    assert metrics.per_request[2]["tpot_ms"] == pytest.approx(200)
    assert metrics.per_request[3]["tpot_ms"] is None  # one token: no TPOT
    assert "slowest TTFT: request 1 (10 prompt tokens): 500.0 ms" in serve_report(metrics)


def sse(chunk) -> bytes:
    return ("data: " + (chunk if isinstance(chunk, str) else json.dumps(chunk))).encode()


def text_chunk(text: str) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}


def test_stream_tracker_times_chunks_and_prefers_usage_counts():
    tracker = StreamTracker(start=10.0, prompt_tokens=7)
    timeline = [
        (10.3, sse(text_chunk("a"))),
        (10.3, b"\n"),
        (10.35, b": keep-alive\n"),
        (10.4, sse(text_chunk("b"))),
        (10.6, sse(text_chunk("c"))),
        (10.6, sse({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 4}})),
        (10.61, sse("[DONE]")),
    ]
    for now, line in timeline:
        tracker.feed(line, now)
    result = tracker.result(end=10.7)
    assert tracker.done and result.ok
    assert result.ttft == pytest.approx(0.3) and result.e2e == pytest.approx(0.7)
    assert result.itls == pytest.approx([0.1, 0.2])
    assert (result.prompt_tokens, result.output_tokens) == (8, 4)  # usage beats counting 3 chunks
    assert result.tpot == pytest.approx(0.4 / 3)


def test_stream_tracker_counts_chunks_without_usage_and_fails_empty_streams():
    tracker = StreamTracker(start=0.0, prompt_tokens=7)
    for now in (0.1, 0.2):
        tracker.feed(sse({**text_chunk("x"), "usage": None}), now)
    assert (tracker.result(0.3).output_tokens, tracker.result(0.3).prompt_tokens) == (2, 7)
    assert not StreamTracker(0.0, 1).result(0.1).ok


def test_send_request_posts_a_streaming_completion_and_reports_http_errors():
    seen = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        if seen[-1]["max_tokens"] == 99:
            return web.json_response({"error": {"message": "too long"}}, status=400)
        body = b"\n\n".join([sse(text_chunk("hi")), sse(text_chunk("!")), sse("[DONE]")]) + b"\n\n"
        return web.Response(body=body, content_type="text/event-stream")

    async def send(max_tokens: int) -> RequestResult:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        payload = completion_payload(BenchRequest("hello", [1, 2, 3], max_tokens), "tiny")
        async with TestServer(app) as server, aiohttp.ClientSession() as client:
            return await send_request(client, str(server.make_url("")).rstrip("/"), payload, prompt_tokens=3)

    ok, failed = asyncio.run(send(2)), asyncio.run(send(99))
    assert ok.ok and ok.output_tokens == 2 and len(ok.itls) == 1
    assert seen[0] == {
        "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    assert not failed.ok and failed.error.startswith("HTTP 400") and "too long" in failed.error


def test_poisson_arrivals_have_the_requested_rate_and_inf_sends_all_at_once():
    assert arrival_offsets(5, math.inf).tolist() == [0.0] * 5
    offsets = arrival_offsets(20_000, request_rate=4.0, seed=3)
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    assert np.diff(offsets).mean() == pytest.approx(0.25, rel=0.03)
    assert arrival_offsets(10, 4.0, seed=3).tolist() == arrival_offsets(10, 4.0, seed=3).tolist()
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


def test_the_drawn_rate_is_the_schedules_own_and_the_report_compares_completions_with_it():
    offsets = np.array([0.0, 1.0, 3.0, 5.0])  # three gaps over 5 s
    assert drawn_rate(offsets) == pytest.approx(0.6)
    assert drawn_rate(arrival_offsets(5, math.inf)) is None and drawn_rate(np.zeros(1)) is None
    # seed 0's 800 arrivals run slow of the nominal rate: a server that keeps up completes fewer a second
    assert drawn_rate(arrival_offsets(800, 2.0, seed=0)) == pytest.approx(799 / 415.6, rel=1e-3)
    results = [RequestResult(ok=True, prompt_tokens=4, output_tokens=2, ttft=0.1, e2e=0.2, sent_at=0.0)] * 3
    metrics = summarize(results, duration=6.0, offered_rate=0.6)
    assert metrics.offered_rate == 0.6 and metrics.to_json()["offered_rate"] == 0.6
    assert "offered as drawn: 0.60 req/s; completed 0.833x that" in serve_report(metrics)
    assert "offered as drawn" not in serve_report(summarize(results, duration=6.0))
