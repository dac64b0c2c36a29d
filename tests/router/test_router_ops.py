"""`llmserve router --api-key` in front of one `llmserve serve` replica: the key is checked and passed
on, a client that leaves mid-stream aborts its request on the replica, and the router's /metrics and
/v1/metrics carry the replica's own series with a `replica` label."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, free_port, start_server, tiny_server_args
from tests.router.conftest import BLOCK_SIZE, router_command, scrape

MODEL = "tiny-llama"


class Router:
    def __init__(self, replica_url: str, model_dir: str, log_path) -> None:
        self.base_url = f"http://127.0.0.1:{free_port()}"
        command = router_command([replica_url], model_dir, int(self.base_url.rsplit(":", 1)[1]))
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*command, "--api-key", API_KEY], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 120
        while not self._healthy():
            assert self.proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def replica(tiny_model_dir, tmp_path_factory):
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"}
    args = ["--block-size", str(BLOCK_SIZE), "--kv-events-config", json.dumps(events)]
    server = start_server(
        tiny_server_args(tiny_model_dir, *args), tmp_path_factory.mktemp("r") / "replica.log", API_KEY
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def router(replica, tiny_model_dir, tmp_path_factory):
    router = Router(replica.base_url, tiny_model_dir, tmp_path_factory.mktemp("router") / "router.log")
    yield router
    router.stop()


def completion(router: Router, key: str | None, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, **body}
    return httpx.post(f"{router.base_url}/v1/completions", json=body, headers=headers, timeout=60)


def test_the_api_key_is_required_and_passed_on_to_the_replica(router):
    for key in (None, "wrong"):
        response = completion(router, key)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert completion(router, API_KEY).status_code == 200  # the replica, behind the same key, accepted it
    assert httpx.get(f"{router.base_url}/health").status_code == 200  # open, as on `llmserve serve`
    assert httpx.get(f"{router.base_url}/metrics").status_code == 200
    assert httpx.get(f"{router.base_url}/v1/metrics").status_code == 401


def test_a_client_that_leaves_mid_stream_aborts_its_request_on_the_replica(router, replica):
    aborted = "llmserve:request_success_total{finished_reason=abort}"
    before = scrape(replica.base_url).get(aborted, 0.0)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", f"{router.base_url}/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        lines = r.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass  # the first chunk with output: the request runs on the replica
    deadline = time.monotonic() + 20
    while scrape(replica.base_url).get(aborted, 0.0) == before:
        assert time.monotonic() < deadline, "the replica's request was not aborted"
        time.sleep(0.2)
    metrics = scrape(replica.base_url)
    assert metrics["llmserve:num_requests_running"] == 0
    assert metrics["llmserve:generation_tokens_total"] < 900


def test_the_routers_metrics_carry_the_replicas_series_with_a_replica_label(router, replica):
    assert completion(router, API_KEY, prompt=list(range(100, 100 + 3 * BLOCK_SIZE))).status_code == 200
    assert completion(router, API_KEY, prompt=list(range(100, 100 + 3 * BLOCK_SIZE)) + [9]).status_code == 200
    own = scrape(replica.base_url)
    routed = scrape(router.base_url)
    label = f"replica={replica.base_url}"
    for name in ("llmserve:prefix_cache_hits_total", "llmserve:prefix_cache_queries_total"):
        assert routed[f"{name}{{{label}}}"] == own[name]
    assert own["llmserve:prefix_cache_hits_total"] >= 3 * BLOCK_SIZE
    assert (
        routed[f"llmserve:request_success_total{{finished_reason=length,{label}}}"]
        == (own["llmserve:request_success_total{finished_reason=length}"])
    )
    snapshot = httpx.get(
        f"{router.base_url}/v1/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
    ).json()
    (row,) = snapshot["replicas"]
    assert row["replica"] == replica.base_url and row["healthy"] and row["requests_routed"]["prefix"] >= 1
    assert snapshot["aggregate"]["prefix_cache_hits"] == own["llmserve:prefix_cache_hits_total"]
    assert snapshot["aggregate"]["prefix_cache_hit_rate"] == pytest.approx(
        own["llmserve:prefix_cache_hits_total"] / own["llmserve:prefix_cache_queries_total"]
    )
