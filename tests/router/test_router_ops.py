"""`llmserve router --api-key` in front of one `llmserve serve` replica: the key is checked and passed
on, a client that leaves mid-stream aborts its request on the replica, the router's /metrics and
/v1/metrics carry the replica's own series with a `replica` label, every other route answers as the
replica does (streams too), and the playground and dashboard work behind the router."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, free_port, start_server, tiny_server_args
from tests.helpers import wait_until
from tests.router.conftest import BLOCK_SIZE, router_command, scrape

pytestmark = pytest.mark.server

MODEL = "tiny-llama"


class Router:
    def __init__(self, replica_url: str, model_dir: str, log_path) -> None:
        self.base_url = f"http://127.0.0.1:{free_port()}"
        command = router_command([replica_url], model_dir, int(self.base_url.rsplit(":", 1)[1]))
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*command, "--api-key", API_KEY], stdout=log, stderr=subprocess.STDOUT
            )

        def ready() -> bool:
            assert self.proc.poll() is None, log_path.read_text()  # it exited: its log says why
            return self._healthy()

        wait_until(ready, 120, "the router's /health")

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
    wait_until(lambda: scrape(replica.base_url).get(aborted, 0.0) != before, 20, "the replica's abort")
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


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _texts(body: dict) -> list[str]:
    """A Responses object's output texts (its ids differ from one response to the next)."""
    return [part["text"] for item in body["output"] for part in item["content"]]


@pytest.mark.parametrize(
    ("path", "body", "answer"),
    [
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 4, "temperature": 0.0}, _texts),
        ("/v1/generate", {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}, lambda b: b["text"]),
        ("/v1/embeddings", {"input": "Hello there"}, lambda b: (b["data"], b["usage"])),
        ("/tokenize", {"prompt": "Hello there"}, lambda b: b),
        ("/detokenize", {"tokens": [5, 6, 7]}, lambda b: b),
        ("/detokenize", {"tokens": [10**9]}, lambda b: b),  # the replica's 400, passed through
        ("/v1/responses", {"input": "Hi", "store": True}, lambda b: b),
    ],
)
def test_each_forwarded_route_answers_as_the_replica_does(router, replica, path, body, answer):
    body = {"model": MODEL, **body} if path != "/v1/generate" else body
    direct, routed = (
        httpx.post(f"{base}{path}", json=body, headers=AUTH, timeout=60)
        for base in (replica.base_url, router.base_url)
    )
    assert routed.status_code == direct.status_code, routed.text
    assert routed.headers["content-type"] == direct.headers["content-type"]
    assert answer(routed.json()) == answer(direct.json())


def _events(base_url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base_url}{path}", json=body, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_responses_and_generate_stream_through_the_router(router, replica):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 5, "temperature": 0.0, "stream": True}
    direct, routed = (_events(base, "/v1/responses", body) for base in (replica.base_url, router.base_url))
    assert [e["type"] for e in routed] == [e["type"] for e in direct]
    assert [e["sequence_number"] for e in routed] == list(range(len(routed)))
    deltas = [e.get("delta") for e in routed if e["type"] == "response.output_text.delta"]
    assert deltas == [e.get("delta") for e in direct if e["type"] == "response.output_text.delta"]
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0.0, "stream": True}
    direct, routed = (_events(base, "/v1/generate", body) for base in (replica.base_url, router.base_url))
    assert [e["text"] for e in routed] == [e["text"] for e in direct] and routed[-1]["done"]


def test_the_playground_and_dashboard_work_behind_the_router(router, replica):
    page = httpx.get(f"{router.base_url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.text == httpx.get(f"{replica.base_url}/", timeout=10).text
    for asset in ("playground.js", "dashboard.js", "style.css"):
        assert httpx.get(f"{router.base_url}/static/{asset}", timeout=10).status_code == 200
    assert httpx.get(f"{router.base_url}/static/secret.txt", timeout=10).status_code == 404
    assert httpx.get(f"{router.base_url}/dashboard", timeout=10).status_code == 200
    # what the playground reads before its first request: the model, and that it must ask for a key
    info = httpx.get(f"{router.base_url}/server_info", timeout=10).json()
    own = httpx.get(f"{replica.base_url}/server_info", timeout=10).json()
    assert info == {**own, "kv_events": None}  # a router publishes no KV events
    # the replica's engine measured its model (worker/memory_report.py), passed through the router
    assert own["weights_memory_bytes"] > 0 and own["weights_file_bytes"] > 0
    assert own["engine_resident_bytes"] is None or own["engine_resident_bytes"] > own["weights_memory_bytes"]
    config = httpx.get(f"{router.base_url}/playground/config", timeout=10).json()
    assert config == {"api_key_required": True}
    models = httpx.get(f"{router.base_url}/v1/models", headers=AUTH, timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    # then the page's chat request, streamed as the page sends it
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    assert any(e["choices"] for e in _events(router.base_url, "/v1/chat/completions", chat))
    # the dashboard's series: the replica's, summed over the replicas (here one)
    stats = httpx.get(f"{router.base_url}/dashboard/stats", timeout=10).json()
    direct = httpx.get(f"{replica.base_url}/dashboard/stats", timeout=10).json()
    assert stats["model"] == MODEL and stats["summary"] == direct["summary"]
    assert isinstance(stats["points"], list)
