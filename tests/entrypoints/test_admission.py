"""Admission by deadline and live invariants against a real server (two running slots)."""

from __future__ import annotations

import json
import math
import re
import threading
import time

import httpx
import pytest

from tests.entrypoints.conftest import start_server, tiny_server_args
from tests.entrypoints.test_server_lifecycle import scrape, wait_idle

pytestmark = pytest.mark.server

MODEL = "tiny-llama"
LONG = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": 900, "ignore_eos": True}
PROMPT_150 = " ".join(["word"] * 150)  # about 150 tokens


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    args = tiny_server_args(
        tiny_model_dir, "--max-num-seqs", "2", "--max-waiting-tokens", "400", "--check-invariants"
    )
    process = start_server(args, tmp_path_factory.mktemp("admission") / "server.log")
    yield process
    process.stop()


def test_queued_requests_past_their_timeout_are_aborted_with_408(server):
    stop = threading.Event()
    threads = _hold_slots(server, 2, stop)  # they wait behind them longer than predicted
    unstreamed: list[httpx.Response] = []
    try:
        body = {**LONG, "max_tokens": 4, "timeout": 1.0}
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            post = threading.Thread(target=lambda: unstreamed.append(http.post("/v1/completions", json=body)))
            post.start()
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                assert stream.status_code == 200
                lines = [
                    line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")
                ]
            post.join(60)
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "408"  # in-band
        assert unstreamed[0].status_code == 408, unstreamed[0].text
        error = unstreamed[0].json()["error"]
        assert error["code"] == "timeout" and error["param"] == "timeout" and "1 s" in error["message"]
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    wait_idle(server)


def _predicted_service(http: httpx.Client, body: dict) -> float:
    """The server's predicted time for `body` on an idle engine, read from the 429 of a tiny timeout."""
    probe = http.post("/v1/completions", json={**body, "timeout": 0.001})
    assert probe.status_code == 429, probe.text  # refused before anything ran
    assert int(probe.headers["Retry-After"]) >= 1
    message = probe.json()["error"]["message"]
    service = float(re.search(r"predicted time of ([\d.]+) s", message).group(1))
    assert service > 0, message
    return service


def _hold_slots(
    server, count: int, stop: threading.Event, extra: dict | None = None
) -> list[threading.Thread]:
    """`count` long streams that read until `stop` is set, then disconnect (aborting them)."""
    started = threading.Barrier(count + 1)

    def run() -> None:
        with (
            httpx.Client(base_url=server.base_url, timeout=120) as http,
            http.stream("POST", "/v1/completions", json={**LONG, **(extra or {}), "stream": True}) as stream,
        ):
            lines = stream.iter_lines()
            next(lines)
            started.wait()
            for _ in lines:
                if stop.is_set():
                    return

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    started.wait(timeout=120)
    return threads


def test_a_predicted_wait_over_the_timeout_is_429_with_a_computed_retry_after(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:  # measured rates first
        http.post("/v1/completions", json={**LONG, "max_tokens": 8}).raise_for_status()
        stop = threading.Event()
        threads = _hold_slots(server, 2, stop)  # both running slots
        try:
            refused = http.post("/v1/completions", json={**LONG, "max_tokens": 4, "timeout": 0.001})
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert "exceeds the request's timeout" in refused.json()["error"]["message"]
            assert int(refused.headers["Retry-After"]) >= 1
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
    wait_idle(server)


def test_queued_prompt_tokens_are_bounded(server):
    stop = threading.Event()
    threads = _hold_slots(server, 2, stop)
    queued = []
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            body = {"model": MODEL, "prompt": PROMPT_150, "max_tokens": 2}
            # two wait behind the running pair (about 300 prompt tokens queued), the third is over 400

            def post() -> None:
                with httpx.Client(base_url=server.base_url, timeout=120) as own:
                    queued.append(own.post("/v1/completions", json=body))

            for _ in range(2):
                thread = threading.Thread(target=post)
                thread.start()
                threads.append(thread)
            deadline = time.monotonic() + 30
            while scrape(server)["llmserve:num_requests_waiting"] < 2:
                assert time.monotonic() < deadline
            refused = http.post("/v1/completions", json=body)
            assert refused.status_code == 429, refused.text
            assert "admits at most 400" in refused.json()["error"]["message"]
            assert int(refused.headers["Retry-After"]) >= 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert [response.status_code for response in queued] == [200, 200]
    metrics = wait_idle(server)
    assert metrics["llmserve:invariant_violations_total"] == 0  # --check-invariants ran every step
    assert "llmserve:engine_stalls_total" in metrics


@pytest.fixture
def fresh_server(tiny_model_dir, tmp_path):
    """A server of its own: no request has run on it, only the engine's warm-up."""
    args = tiny_server_args(tiny_model_dir, "--max-num-seqs", "2")
    process = start_server(args, tmp_path / "server.log")
    yield process
    process.stop()


def test_a_cold_start_burst_is_refused_with_429_and_a_computed_retry_after(fresh_server):
    server = fresh_server  # its predictor has only the warm-up's steps (the prior)
    burst = {**LONG, "max_tokens": 100}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        service = _predicted_service(http, burst)
        # long enough that scheduling jitter is small beside it, on a fast machine too
        burst["max_tokens"] = min(900, max(100, math.ceil(100 * 0.5 / service)))
        service = _predicted_service(http, burst)
        bad = http.post("/v1/completions", json={**LONG, "timeout": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout"

    # 12 at once on 2 running slots, each given 3 of its services: at most three rounds fit, the rest cannot
    def post(results: list) -> None:
        with httpx.Client(base_url=server.base_url, timeout=120) as own:
            results.append(own.post("/v1/completions", json={**burst, "timeout": 3 * service}))

    results: list[httpx.Response] = []
    threads = [threading.Thread(target=post, args=(results,)) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    statuses = sorted(response.status_code for response in results)
    refused = [response for response in results if response.status_code == 429]
    assert set(statuses) <= {200, 408, 429} and len(refused) >= 4 and statuses.count(200) >= 2, statuses
    assert all(int(response.headers["Retry-After"]) >= 1 for response in refused)
    assert all("exceeds the request's timeout" in r.json()["error"]["message"] for r in refused)
    assert statuses.count(408) <= 2, statuses  # admitted ones were predicted to fit, and nearly all did
    wait_idle(server)  # the timed-out ones' blocks are back
