"""Smoke runs of the reliability figures' tools (docs/reliability.md) against the tiny model: the
overload burst, then an engine kill under load (which restarts the server's engine)."""

from __future__ import annotations

import json

import pytest

from benchmarks.tools import engine_kill, overload
from tests.entrypoints.conftest import start_server, tiny_server_args

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("reliability-tools") / "server.log"
    process = start_server(tiny_server_args(tiny_model_dir, "--max-num-seqs", "2"), log)
    yield process
    process.stop()


def test_overload_counts_429s_and_retries_them(server, tmp_path):
    out = tmp_path / "overload.json"
    argv = ["--url", server.base_url, "--num-requests", "12", "--timeout", "0.5", "--max-tokens", "200"]
    assert overload.main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 12 and result["other"] == 0
    assert result["admitted"] + result["refused_429"] == 12
    assert result["refused_429"] > 0 and result["retry_after_s"]["p50"] >= 1  # the warm-up's prior


def test_engine_kill_times_the_restart_under_load(server, tmp_path):
    out = tmp_path / "engine_kill.json"
    # a kill landing while every in-flight request's last chunks are on their way (the engine done, the
    # server still streaming) ends none with an error: the clients start 50 ms apart so that their
    # requests do not end in one step, and 256 tokens keep those windows a small part of each request
    argv = ["--url", server.base_url, "--concurrency", "2", "--max-tokens", "256", "--load-seconds", "1"]
    assert engine_kill.main([*argv, "--kills", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    [kill] = result["rounds"]
    assert 0 < kill["kill_to_health_503_s"] < kill["kill_to_health_200_s"]
    assert kill["kill_to_first_completion_s"] > kill["kill_to_health_503_s"]
    # in flight as the client sees it: a request whose last chunk was already on its way at the kill
    # ends ok, so at least one, not every one, ends with an error
    assert kill["in_flight_at_kill"] >= 1 and kill["in_flight_ended_with_error"] >= 1
    assert kill["orphans"] == [] and sum(kill["sent_while_restarting"].values()) > 0
    assert engine_kill.engine_process(server.proc.pid).pid != kill["killed_pid"]  # a new one serves
