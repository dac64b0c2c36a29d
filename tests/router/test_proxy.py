"""The proxy's re-send rules against scripted replicas (httpx.MockTransport): a request goes elsewhere
while its client has seen nothing, and a stream that fails after its first output ends with an error."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.responses import StreamingResponse

from llmserve.router.index import PrefixIndex
from llmserve.router.policy import RoutingPolicy
from llmserve.router.proxy import NoReplicaError, Proxy
from llmserve.router.replica import Replica
from tests.router.test_routing_units import INFO

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


class Script(httpx.AsyncByteStream):
    """Sends `chunks`, then fails the connection if `then_fail`."""

    def __init__(self, chunks: list[bytes], then_fail: bool) -> None:
        self.chunks, self.then_fail = chunks, then_fail

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        if self.then_fail:
            raise httpx.ReadError("connection reset")


def run(behaviours: dict[str, object], stream: bool = False):
    """Forward one request over replicas r0, r1 answering as scripted; (response body, replicas, calls)."""
    calls: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        calls.append(host)
        behaviour = behaviours[host]
        if behaviour == "refuse":
            raise httpx.ConnectError("connection refused")
        if behaviour == "unwrapped":  # what httpcore let through once as a replica died (anyio's socket gone)
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        status, chunks, then_fail = behaviour
        return httpx.Response(status, stream=Script(chunks, then_fail))

    async def forward():
        replicas = [Replica(f"http://r{i}", INFO) for i in range(2)]
        client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
        proxy = Proxy(client, replicas, RoutingPolicy(PrefixIndex([r.url for r in replicas]), 4))
        try:
            response = await proxy.forward("/v1/chat/completions", b"{}", {}, [], stream)
        except NoReplicaError as error:
            return error.message, replicas, calls
        if isinstance(response, StreamingResponse):
            body = b"".join([chunk async for chunk in response.body_iterator])
        else:
            body = response.body
        assert all(r.in_flight == 0 for r in replicas), "every slot is released"
        return body, replicas, calls

    return asyncio.run(forward())


def test_a_refused_connection_goes_to_the_next_replica_and_marks_the_first_down():
    body, replicas, calls = run({"r0": "refuse", "r1": (200, [b'{"ok": 1}'], False)})
    assert (body, calls) == (b'{"ok": 1}', ["r0", "r1"])
    assert not replicas[0].healthy and replicas[1].healthy


def test_an_error_the_client_leaves_unwrapped_sends_the_request_on_without_marking_the_replica():
    body, replicas, calls = run({"r0": "unwrapped", "r1": (200, [b'{"ok": 1}'], False)})
    assert (body, calls) == (b'{"ok": 1}', ["r0", "r1"])
    assert replicas[0].healthy  # an unknown error: the health checks judge the replica


@pytest.mark.parametrize("status", [429, 503])
def test_a_busy_or_dead_replica_passes_the_request_on(status):
    body, _, calls = run({"r0": (status, [b"{}"], False), "r1": (200, [b'{"ok": 1}'], False)})
    assert (body, calls) == (b'{"ok": 1}', ["r0", "r1"])


def test_a_plain_response_cut_off_is_sent_again():
    body, _, calls = run({"r0": (200, [b'{"ok"'], True), "r1": (200, [b'{"ok": 1}'], False)})
    assert (body, calls) == (b'{"ok": 1}', ["r0", "r1"])


def test_a_client_error_is_passed_through_not_retried():
    body, _, calls = run({"r0": (400, [b'{"error": {}}'], False), "r1": (200, [b"{}"], False)})
    assert (body, calls) == (b'{"error": {}}', ["r0"])


def test_a_stream_that_failed_before_output_is_sent_again_without_its_role_chunk():
    body, _, calls = run({"r0": (200, [ROLE], True), "r1": (200, [ROLE, TOKEN, DONE], False)}, stream=True)
    assert (body, calls) == (ROLE + TOKEN + DONE, ["r0", "r1"])


def test_a_stream_that_failed_after_output_ends_with_an_error_event():
    body, replicas, calls = run({"r0": (200, [ROLE, TOKEN], True), "r1": (200, [DONE], False)}, stream=True)
    events = body.decode().strip().split("\n\n")
    assert calls == ["r0"] and events[:2] == [ROLE.decode().strip(), TOKEN.decode().strip()]
    error = json.loads(events[2].removeprefix("data: "))["error"]
    assert "failed mid-stream" in error["message"] and events[3] == "data: [DONE]"
    assert not replicas[0].healthy


def test_no_replica_left_is_an_error_naming_the_last_failure():
    message, _, calls = run({"r0": "refuse", "r1": "refuse"})
    assert calls == ["r0", "r1"]
    assert message.startswith("no replica could serve the request: http://r1: connection refused")


def test_a_broadcast_reaches_every_replica_and_answers_with_the_first_failure():
    """Run-time LoRA loading: every replica gets the POST; all succeed -> the first answer; a refusal
    -> that refusal; an unreachable replica -> NoReplicaError naming it, marked down."""

    def broadcast(answers: dict[str, object]):
        calls: list[tuple[str, bytes]] = []

        def handle(request: httpx.Request) -> httpx.Response:
            calls.append((request.url.host, request.content))
            answer = answers[request.url.host]
            if answer == "refuse":
                raise httpx.ConnectError("connection refused")
            return httpx.Response(answer[0], content=answer[1], headers={"content-type": "text/plain"})

        async def send():
            replicas = [Replica(f"http://r{i}", INFO) for i in range(2)]
            client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
            proxy = Proxy(client, replicas, RoutingPolicy(PrefixIndex([r.url for r in replicas]), 4))
            try:
                response = await proxy.broadcast("/v1/load_lora_adapter", b'{"lora_name": "a"}', {})
            except NoReplicaError as error:
                return error.message, replicas, calls
            return (response.status_code, response.body), replicas, calls

        return asyncio.run(send())

    result, _, calls = broadcast({"r0": (200, b"Success"), "r1": (200, b"Success")})
    assert result == (200, b"Success")
    assert sorted(calls) == [("r0", b'{"lora_name": "a"}'), ("r1", b'{"lora_name": "a"}')]
    result, _, _ = broadcast({"r0": (200, b"Success"), "r1": (400, b'{"error": "bad path"}')})
    assert result == (400, b'{"error": "bad path"}')
    message, replicas, calls = broadcast({"r0": (200, b"Success"), "r1": "refuse"})
    assert "http://r1" in message and not replicas[1].healthy and replicas[0].healthy
    assert len(calls) == 2
