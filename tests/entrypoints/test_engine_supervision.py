"""Engine supervision against a real server: SIGKILL its engine process under streams."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.entrypoints.conftest import start_server, tiny_server_args
from tests.entrypoints.test_server_lifecycle import scrape
from tests.helpers import wait_until

pytestmark = pytest.mark.server

LONG = {"model": "tiny-llama", "prompt": "Tell me everything", "max_tokens": 900, "ignore_eos": True}


def engine_processes(server) -> list[psutil.Process]:
    """The server's engine processes (its multiprocessing resource tracker, if any, is not one)."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    return [child for child in children if "resource_tracker" not in " ".join(child.cmdline())]


def stream_until_end(server, results: list, started: threading.Event) -> None:
    """One stream: record its last event (an error, or finish_reason) once it ends."""
    with (
        httpx.Client(base_url=server.base_url, timeout=120) as http,
        http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response,
    ):
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                started.set()
                events.append(line.removeprefix("data: "))
        results.append(events)


def health(server) -> tuple[int, dict]:
    response = httpx.get(server.base_url + "/health", timeout=5)
    return response.status_code, response.json()


def test_a_killed_engine_fails_its_streams_and_is_restarted(tiny_model_dir, tmp_path):
    server = start_server(tiny_server_args(tiny_model_dir), tmp_path / "server.log")
    try:
        assert health(server) == (200, {"status": "healthy", "state": "ready"})  # warmed up first
        [engine] = engine_processes(server)
        results: list = []
        started = [threading.Event() for _ in range(3)]
        threads = [threading.Thread(target=stream_until_end, args=(server, results, s)) for s in started]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(60)
        killed_at = time.monotonic()
        engine.send_signal(signal.SIGKILL)
        for thread in threads:
            thread.join(60)
        assert len(results) == 3
        for events in results:  # each stream ends its open choice with finish_reason "abort"
            finishes = [c["finish_reason"] for e in events if e != "[DONE]" for c in json.loads(e)["choices"]]
            assert finishes[-1] == "abort" and finishes.count("abort") == 1, events[-3:]
        assert "the engine process exited unexpectedly (exit code -9)" in server.log()
        status, body = wait_until(lambda: (s := health(server))[0] == 503 and s, 30, "/health 503")
        assert body["status"] == "restarting" and "exit code -9" in body["reason"]
        assert body["error"]["type"] == "server_error"
        refused = httpx.post(server.base_url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
        assert refused.status_code == 503 and "restarting" in refused.json()["error"]["message"]
        wait_until(lambda: health(server)[0] == 200, 120, "/health 200 after the restart")
        recovered = time.monotonic() - killed_at
        served = httpx.post(server.base_url + "/v1/completions", json={**LONG, "max_tokens": 4}, timeout=60)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
        assert health(server) == (200, {"status": "healthy", "state": "ready"})
        assert not engine.is_running()  # reaped: no orphan, no zombie (psutil checks the pid's start time)
        [new_engine] = engine_processes(server)
        assert new_engine.pid != engine.pid
        assert scrape(server)["llmserve:engine_restarts_total"] == 1
        assert "the engine process restarted (restart 1)" in server.log()
        print(f"engine kill to serving again: {recovered:.1f} s")
    finally:
        assert server.stop() == 0
    assert not psutil.pid_exists(new_engine.pid)


def test_no_engine_restart_exits_non_zero(tiny_model_dir, tmp_path):
    server = start_server(tiny_server_args(tiny_model_dir, "--no-engine-restart"), tmp_path / "server.log")
    try:
        [engine] = engine_processes(server)
        engine.send_signal(signal.SIGKILL)
        assert server.proc.wait(timeout=30) == 1
        assert "will not be restarted" in server.log()
    finally:
        server.stop()
    assert not psutil.pid_exists(engine.pid)
