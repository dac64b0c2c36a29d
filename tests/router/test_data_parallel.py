"""`llmserve serve --data-parallel-size 2` on the tiny model: the OpenAI client through the router,
shared prefixes kept on one replica each (counted by the replicas' own prefix-cache hits), unique
prompts spread evenly, a replica killed mid-run losing no request that had not started, and every
replica stopped with the server; `llmserve router` refusing a replica it cannot reach."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, free_port, start_server, tiny_server_args
from tests.helpers import wait_until
from tests.router.conftest import BLOCK_SIZE, replica_urls, router_command, scrape

pytestmark = pytest.mark.server

MODEL = "tiny-llama"
PREFIX_BLOCKS = 3
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir, tmp_path_factory):
    # one health check at start-up only: the least-loaded choice then sees the router's own counts
    # alone, so that which replica gets a unique prompt does not hinge on when metrics were read
    # two sequences at a time per replica: most requests sent to one wait in its queue, not started
    args = ["--data-parallel-size", "2", "--block-size", str(BLOCK_SIZE), "--health-interval", "600"]
    args += ["--max-num-seqs", "2"]
    log = tmp_path_factory.mktemp("dp") / "server.log"
    server = start_server(tiny_server_args(tiny_model_dir, *args), log, api_key=API_KEY)
    yield server
    server.stop()


def routed(router_url: str, reason: str) -> dict[str, float]:
    metrics = scrape(router_url)
    return {
        url: metrics.get(f"llmserve_router:requests_routed_total{{reason={reason},replica={url}}}", 0.0)
        for url in replica_urls(router_url)
    }


def hits(urls: list[str]) -> dict[str, float]:
    return {url: scrape(url)["llmserve:prefix_cache_hits_total"] for url in urls}


def hits_through_router(router_url: str) -> dict[str, float]:
    """Each replica's hit counter as the router's /metrics serves it, under a `replica` label."""
    metrics = scrape(router_url)
    return {
        url: metrics[f"llmserve:prefix_cache_hits_total{{replica={url}}}"] for url in replica_urls(router_url)
    }


def complete(server, prompt: list[int] | str, max_tokens: int = 2) -> dict:
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
        headers=server.headers,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_health_names_two_replicas_and_the_openai_client_works_through_the_router(dp_server):
    assert httpx.get(f"{dp_server.base_url}/health").status_code == 200
    assert len(replica_urls(dp_server.base_url)) == 2
    client = openai.OpenAI(base_url=f"{dp_server.base_url}/v1", api_key=API_KEY, max_retries=0)
    assert [model.id for model in client.models.list()] == [MODEL]
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert completion.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi there"}],
        max_tokens=6,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    with pytest.raises(openai.AuthenticationError):  # the replicas check the key the router passes on
        openai.OpenAI(base_url=f"{dp_server.base_url}/v1", api_key="wrong", max_retries=0).models.list()


def test_each_shared_prefix_stays_on_one_replica(dp_server):
    urls = replica_urls(dp_server.base_url)
    before_hits, before_prefix = hits(urls), routed(dp_server.base_url, "prefix")
    before_routed_hits = hits_through_router(dp_server.base_url)
    prefixes = [[1000 + 100 * p + i for i in range(PREFIX_BLOCKS * BLOCK_SIZE)] for p in range(2)]
    follow_ups = 5
    for turn in range(follow_ups + 1):
        for prefix in prefixes:
            complete(dp_server, prefix + [7000 + turn, 7100 + turn, 7200 + turn])
    # a prefix split over both replicas would be computed on each: fewer hits than this
    want = len(prefixes) * follow_ups * PREFIX_BLOCKS * BLOCK_SIZE
    hit_tokens = lambda: sum(after - before_hits[url] for url, after in hits(urls).items())
    # the last steps' counts may reach /metrics after their responses: wait for them
    wait_until(lambda: hit_tokens() >= want, 10, lambda: f"{want} hit tokens (seen {hit_tokens()})")
    assert hit_tokens() == want
    by_replica = {
        url: after - before_routed_hits[url] for url, after in hits_through_router(dp_server.base_url).items()
    }
    # the router's /metrics serves each replica's own counter under its `replica` label
    assert by_replica == {url: after - before_hits[url] for url, after in hits(urls).items()}
    by_prefix = sum(routed(dp_server.base_url, "prefix").values()) - sum(before_prefix.values())
    assert by_prefix == len(prefixes) * follow_ups


def test_unique_prompts_spread_evenly(dp_server):
    before = routed(dp_server.base_url, "load")
    for index in range(8):
        complete(dp_server, [3000 + 50 * index + i for i in range(40)])
    after = routed(dp_server.base_url, "load")
    assert sorted(after[url] - before[url] for url in after) == [4, 4]


def test_a_chat_conversation_follows_its_earlier_turns(dp_server):
    system = {"role": "system", "content": "You are a terse assistant who answers in French. " * 6}
    before = routed(dp_server.base_url, "prefix")
    for question in ("Bonjour?", "Quelle heure est-il?", "Pourquoi?"):
        response = httpx.post(
            f"{dp_server.base_url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [system, {"role": "user", "content": question}],
                "max_tokens": 2,
            },
            headers=dp_server.headers,
            timeout=60,
        )
        assert response.status_code == 200, response.text
    assert sum(routed(dp_server.base_url, "prefix").values()) - sum(before.values()) == 2


def test_an_unreachable_replica_is_a_one_line_error(dp_server, tiny_model_dir):
    dead = f"http://127.0.0.1:{free_port()}"
    command = router_command([replica_urls(dp_server.base_url)[0], dead], tiny_model_dir, free_port())
    result = subprocess.run(
        [*command, "--register-timeout", "1"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert errors[0].startswith(f"llmserve: error: replica {dead} is unreachable: ")


def test_a_replica_url_must_be_http(tiny_model_dir):
    result = subprocess.run(
        router_command(["ftp://x"], tiny_model_dir, free_port()), capture_output=True, text=True, timeout=120
    )
    assert (
        result.returncode == 2
        and result.stderr.strip() == "llmserve: error: --replica 'ftp://x' must be an http:// or https:// URL"
    )


def test_a_killed_replica_loses_no_request_that_had_not_started(dp_server):
    victim_url = replica_urls(dp_server.base_url)[0]
    victim = _replica_pid(dp_server.proc.pid, victim_url)
    victim_engine = _descendants(victim)
    first_output = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(_request, dp_server, i, i % 2 == 0, first_output) for i in range(16)]
        assert first_output.wait(60)
        os.kill(victim, signal.SIGKILL)
        results = [future.result(timeout=120) for future in futures]
    failed = [r for r in results if r != "complete"]
    # only streams that had sent output may fail: at most the two the victim was running
    assert all(r.startswith("stream failed") and "failed mid-stream" in r for r in failed), failed
    assert len(failed) <= 2
    assert scrape(dp_server.base_url)["llmserve_router:requests_resent_total"] >= 1, (
        "queued requests went elsewhere"
    )
    health = httpx.get(f"{dp_server.base_url}/health", timeout=10)
    assert health.status_code == 503 and victim_url in health.json()["error"]["message"]
    assert _request(dp_server, 99, False, threading.Event()) == "complete"  # routed around it
    _wait_gone(victim_engine)  # the dead replica's engine process does not outlive it


def _replica_pid(parent: int, url: str) -> int:
    port = url.rsplit(":", 1)[1]
    for pid in _descendants(parent):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--port" in argv and argv[argv.index(b"--port") + 1] == port.encode():
            return pid
    raise AssertionError(f"no process serves {url}")


def _request(server, index: int, stream: bool, first_output: threading.Event) -> str:
    """'complete', or how the request ended otherwise."""
    body = {
        "model": MODEL,
        "prompt": [5000 + 40 * index + i for i in range(20)],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }
    url = f"{server.base_url}/v1/completions"
    with httpx.Client(timeout=httpx.Timeout(60.0), headers=server.headers) as client:
        if not stream:
            response = client.post(url, json=body)
            tokens = response.json()["usage"]["completion_tokens"] if response.status_code == 200 else 0
            return "complete" if tokens == MAX_TOKENS else f"HTTP {response.status_code}: {response.text}"
        with client.stream("POST", url, json=body) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    first_output.set()
    chunks = [json.loads(event) for event in events if event != "[DONE]"]
    if events[-1:] == ["[DONE]"] and chunks and "error" in chunks[-1]:
        return f"stream failed: {chunks[-1]['error']['message']}"
    finished = [c for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason") == "length"]
    return "complete" if finished and events[-1:] == ["[DONE]"] else f"stream ended early: {events[-3:]}"


def test_stopping_the_server_stops_every_replica(dp_server):
    children = _descendants(dp_server.proc.pid)
    assert len(children) >= 2  # the replicas' servers and engines, less the one killed above
    dp_server.proc.send_signal(signal.SIGTERM)
    assert dp_server.proc.wait(timeout=60) == 0
    _wait_gone(children)


def _wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    running = lambda: [pid for pid in pids if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)]
    wait_until(lambda: not running(), timeout, lambda: f"every replica process to exit ({running()} left)")


def _descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *_descendants(int(child))]
    return found


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return True
