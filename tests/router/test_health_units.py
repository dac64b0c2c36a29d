"""The health checker against scripted replicas (httpx.MockTransport): a replica whose engine reports
a dead rank is taken out with the engine's message, and one that comes back is taken in again once
its health check passes and it is still the replica it registered as."""

from __future__ import annotations

import asyncio

import httpx

from llmserve.router.index import PrefixIndex
from llmserve.router.policy import RoutingPolicy
from llmserve.router.replica import HealthChecker, Replica
from tests.router.test_routing_units import INFO

METRICS = "# TYPE llmserve:num_requests_waiting gauge\nllmserve:num_requests_waiting 3.0\n"
DEAD_RANK = "tensor-parallel rank 1 (pid 42) exited with code -9"


def check(replica: Replica, answers: dict[str, httpx.Response]) -> None:
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: answers[request.url.path]))
    asyncio.run(HealthChecker(client, [replica], 1.0).check(replica))


def ok(info=INFO) -> dict[str, httpx.Response]:
    return {
        "/health": httpx.Response(200),
        "/server_info": httpx.Response(200, content=info.model_dump_json()),
        "/metrics": httpx.Response(200, text=METRICS),
    }


def test_a_dead_rank_takes_the_replica_out_with_the_engines_message():
    replica = Replica("http://r0", INFO)
    error = {"error": {"message": DEAD_RANK, "type": "server_error", "param": None, "code": None}}
    check(replica, {**ok(), "/health": httpx.Response(503, json=error)})
    assert not replica.healthy
    assert replica.last_error == f"/health answered HTTP 503: {DEAD_RANK}"


def test_a_replica_that_comes_back_is_taken_in_once_its_check_passes():
    replicas = [Replica("http://r0", INFO), Replica("http://r1", INFO)]
    replicas[0].mark_failed("connection refused")
    policy = RoutingPolicy(PrefixIndex([r.url for r in replicas]), 4)
    candidates = [r for r in replicas if r.healthy]
    assert [policy.choose(candidates, []).replica.url for _ in range(2)] == ["http://r1"] * 2
    replicas[1].in_flight = 4  # busier than r0 once r0 is back with its 3 waiting
    check(replicas[0], ok())
    assert replicas[0].healthy and replicas[0].num_waiting == 3
    assert policy.choose([r for r in replicas if r.healthy], []).replica.url == "http://r0"


def test_a_replica_that_came_back_as_something_else_stays_out():
    replica = Replica("http://r0", INFO)
    replica.mark_failed("connection refused")
    check(replica, ok(INFO.model_copy(update={"block_size": 8})))
    assert not replica.healthy and "block_size 8" in replica.last_error
