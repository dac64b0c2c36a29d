"""Every /health state seen over HTTP on a real `llmserve serve`: starting while the model loading is
held, warming while the warm-up is held, ready, stalled while an injected hang holds a step past the
watchdog's limit, ready again, and stopping while the server drains on SIGTERM. (`restarting` after an
engine kill: test_engine_supervision.py.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from tests.entrypoints.conftest import free_port, tiny_server_args
from tests.helpers import wait_until

pytestmark = pytest.mark.server

MARK = 4242  # a prompt starting with this token id hangs its step until the test releases it

# The server, with faults injected into the engine before it is forked (so its engine process has
# them): the model loading, the warm-up and the marked step each wait until the test, having seen
# the state they hold, creates their file in the folder argv[1] names.
LAUNCH = """
import sys, time
from pathlib import Path
import llmserve.engine.engine_core as engine_core
from llmserve.cli.main import main
from llmserve.engine.llm_engine import LLMEngine

gates = Path(sys.argv[1])
load, warm_up, execute = LLMEngine.__init__, engine_core.warm_up, LLMEngine._execute

def held_until(name):
    deadline = time.monotonic() + 120
    while not (gates / name).exists() and time.monotonic() < deadline:
        time.sleep(0.05)

def slow_load(self, args, **kwargs):
    held_until("load")
    load(self, args, **kwargs)

def slow_warm_up(engine):
    held_until("warm-up")
    return warm_up(engine)

def hanging_execute(self, plan):
    if any(r.prompt_token_ids[0] == MARK for r in self.scheduler.running):
        held_until("step")
    return execute(self, plan)

LLMEngine.__init__, engine_core.warm_up, LLMEngine._execute = slow_load, slow_warm_up, hanging_execute
sys.exit(main(sys.argv[2:]))
""".replace("MARK", str(MARK))


def probe(base_url: str) -> tuple[int, str] | None:
    """/health's (status, state); None while nothing listens."""
    try:
        response = httpx.get(base_url + "/health", timeout=2)
    except httpx.TransportError:
        return None
    return response.status_code, response.json()["state"]


def watch(base_url: str, until, timeout: float, seen: list | None = None) -> list[tuple[int, str]]:
    """The distinct (status, state) in order, after those `seen` before, polled until `until(last)`."""
    seen = [] if seen is None else seen

    def reached() -> bool:
        now = probe(base_url)
        if now is not None and (not seen or seen[-1] != now):
            seen.append(now)
        return now is not None and until(now)

    wait_until(reached, timeout, lambda: f"the next /health state; it was {seen}")
    return seen


def test_every_health_state_is_observable_over_http(tiny_model_dir, tmp_path):
    port, gates = free_port(), tmp_path / "gates"
    gates.mkdir()
    base_url = f"http://127.0.0.1:{port}"
    # factor 1: the limit is the predicted largest step itself, which a loaded CI machine's warm-up
    # can stretch past the hang's 120 s at the default factor
    args = tiny_server_args(
        tiny_model_dir,
        "--watchdog-min-seconds",
        "1",
        "--watchdog-factor",
        "1",
        "--shutdown-drain-seconds",
        "3",
    )
    command = [sys.executable, "-c", LAUNCH, str(gates), "serve", "--port", str(port), *args]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        seen = watch(base_url, lambda now: now == (503, "starting"), 120)
        early = httpx.post(base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=5)
        assert early.status_code == 503 and early.json()["error"]["type"] == "server_error"
        body = httpx.get(base_url + "/health", timeout=5).json()
        assert body["status"] == "starting" and body["error"]["code"] == "503", body
        (gates / "load").touch()
        watch(base_url, lambda now: now == (503, "warming"), 180, seen)
        (gates / "warm-up").touch()
        watch(base_url, lambda now: now == (200, "ready"), 180, seen)
        assert _in_order(seen, [(503, "starting"), (503, "warming"), (200, "ready")]), seen

        hung: list[httpx.Response] = []
        body = {"prompt": [MARK, 5, 6], "max_tokens": 2}
        request = threading.Thread(
            target=lambda: hung.append(httpx.post(base_url + "/v1/completions", json=body, timeout=180))
        )
        request.start()
        stalled = watch(base_url, lambda now: now == (503, "stalled"), 120)
        (gates / "step").touch()  # the step finishes: progress again
        watch(base_url, lambda now: now == (200, "ready"), 60)
        request.join(60)
        assert hung[0].status_code == 200, hung[0].text
        assert stalled[-1] == (503, "stalled")
        metrics = httpx.get(base_url + "/metrics", timeout=5).text
        assert re.search(r"^llmserve:engine_stalls_total(\{[^}]*\})? 1\.0$", metrics, re.MULTILINE), metrics

        proc.send_signal(signal.SIGTERM)
        watch(base_url, lambda now: now == (503, "stopping"), 10)  # draining: still answering
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    assert "engine stalled" in text and "Traceback" not in text, text[-3000:]


def _in_order(seen: list, expected: list) -> bool:
    """Whether `expected` occurs in `seen` in this order (other entries may come between)."""
    position = 0
    for entry in seen:
        if position < len(expected) and entry == expected[position]:
            position += 1
    return position == len(expected)
