"""Forwards one request to the chosen replica and its answer back, re-sending what had not started.

A request has started once a byte of generated output has gone to the client. Until then a replica
that cannot be reached, drops the connection, or answers 429/502/503/504 costs nothing visible: the
request goes to the next replica the policy picks, each replica tried at most once. A plain response
is read whole before it is sent, so it never starts before it is complete. A stream's first events
(the chat role chunks, empty text, a Responses stream's `response.created` and `response.in_progress`)
are held back until the first event that carries output; once
that is sent, a replica that fails ends the stream with an error event and [DONE], since the client
already holds part of an answer that another replica would not continue token for token.

The request body and the Authorization header pass through unchanged: each replica checks its own
API key, and tokens stream through as the replica sends them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import httpx
from starlette.responses import Response, StreamingResponse

from llmserve.router.policy import RoutingPolicy
from llmserve.router.replica import Replica

logger = logging.getLogger("llmserve.router")

RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
FORWARDED_HEADERS = ("authorization", "content-type", "accept")


class NoReplicaError(Exception):
    """No replica could take the request; `message` says why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Proxy:
    def __init__(
        self,
        client: httpx.AsyncClient,
        replicas: Sequence[Replica],
        policy: RoutingPolicy,
        on_routed: Callable[[Replica, int, bool, bool], None] = lambda replica, blocks, by_prefix, resent: (
            None
        ),
    ) -> None:
        self.client = client
        self.replicas = replicas
        self.policy = policy
        self.on_routed = on_routed  # metrics: (replica, matched blocks, by prefix, a re-send)

    async def forward(
        self, path: str, body: bytes, headers: dict[str, str], hashes: Sequence[bytes], stream: bool
    ) -> Response:
        tried: set[str] = set()
        last_error = "no replica is healthy"
        while True:
            candidates = [r for r in self.replicas if r.healthy and r.url not in tried]
            choice = self.policy.choose(candidates, hashes)
            if choice is None:
                raise NoReplicaError(f"no replica could serve the request: {last_error}")
            replica = choice.replica
            self.on_routed(replica, choice.matched_blocks, choice.by_prefix, bool(tried))
            tried.add(replica.url)
            self.policy.index.note_routed(replica.url, hashes)
            replica.in_flight += 1
            streaming = False
            try:
                response = await self._attempt(replica, path, body, headers, stream, len(candidates) == 1)
                streaming = isinstance(response, StreamingResponse)  # its iterator releases the slot
                return response
            except _NotStarted as error:
                last_error = f"{replica.url}: {error}"
            finally:
                if not streaming:
                    replica.in_flight -= 1

    async def broadcast(self, path: str, body: bytes, headers: dict[str, str]) -> Response:
        """POST to every replica (run-time LoRA loading: a request naming the adapter may go to any):
        the first replica's answer when all succeed, else the first failure's. An unreachable replica
        is marked down and raises NoReplicaError naming it (the others have the change; a retry
        repeats it)."""

        async def send(replica: Replica) -> httpx.Response | str:
            try:
                return await self.client.post(f"{replica.url}{path}", content=body, headers=headers)
            except httpx.TransportError as error:
                replica.mark_failed(_describe(error))
                return f"replica {replica.url} could not be reached: {_describe(error)}"

        answers = await asyncio.gather(*(send(replica) for replica in self.replicas))
        unreachable = [answer for answer in answers if isinstance(answer, str)]
        if unreachable:
            raise NoReplicaError("; ".join(unreachable))
        failed = [answer for answer in answers if answer.status_code >= 400]
        answer = failed[0] if failed else answers[0]
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    async def _attempt(
        self, replica: Replica, path: str, body: bytes, headers: dict[str, str], stream: bool, last_try: bool
    ) -> Response:
        """The replica's response, or _NotStarted if it failed before the client saw any output."""
        request = self.client.build_request("POST", replica.url + path, content=body, headers=headers)
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.TransportError as error:
            replica.mark_failed(_describe(error))
            raise _NotStarted(_describe(error)) from None
        except Exception as error:  # one httpx leaves unwrapped (a socket closed as the replica died)
            logger.warning("sending to %s failed: %r", replica.url, error)
            raise _NotStarted(f"{type(error).__name__}: {error}") from None
        if upstream.status_code in RETRYABLE_STATUS and not last_try:
            await upstream.aclose()
            raise _NotStarted(f"HTTP {upstream.status_code}")
        try:
            if not stream or upstream.status_code != 200:
                content = await upstream.aread()
                await upstream.aclose()
                return Response(
                    content, upstream.status_code, media_type=upstream.headers.get("content-type")
                )
            events = upstream.aiter_raw()
            held = await _hold_until_output(events)
        except BaseException as error:  # the replica failed, or the client left (cancellation)
            await upstream.aclose()
            if not isinstance(error, httpx.TransportError):
                raise
            replica.mark_failed(_describe(error))
            raise _NotStarted(_describe(error)) from None
        return StreamingResponse(
            _pass_through(held, events, replica, upstream), media_type="text/event-stream"
        )


class _NotStarted(Exception):
    """The attempt failed before any output reached the client: the request may go elsewhere."""


async def _hold_until_output(chunks: AsyncIterator[bytes]) -> bytes:
    """Read the stream's first events up to and including one that carries output (or its end)."""
    held = b""
    async for chunk in chunks:
        held += chunk
        if any(_carries_output(event) for event in held.split(b"\n\n")[:-1]):
            return held
    return held


# A Responses stream's first events: the response's id and status, nothing of the answer yet.
_RESPONSE_STARTED = frozenset({"response.created", "response.in_progress"})


def _carries_output(event: bytes) -> bool:
    """Whether an SSE event gives the client something of the answer (not a role-only chunk, not a
    Responses stream's opening events)."""
    data = [line for line in event.strip().split(b"\n") if line.startswith(b"data:")]
    try:
        body = json.loads(data[0].removeprefix(b"data:").strip())
    except (IndexError, ValueError):
        return True  # [DONE], or something this router does not know: not safe to repeat
    if isinstance(body, dict) and body.get("type") in _RESPONSE_STARTED:
        return False
    choices = body.get("choices") if isinstance(body, dict) else None
    if not choices or body.get("usage"):
        return True
    return any(
        choice.get("text") or choice.get("finish_reason") or (choice.get("delta") or {}).get("content")
        for choice in choices
    )


async def _pass_through(
    held: bytes, rest: AsyncIterator[bytes], replica: Replica, upstream: httpx.Response
) -> AsyncIterator[bytes]:
    """The stream to the client; closing it (the client left) closes the replica's, which aborts there."""
    try:
        yield held
        async for chunk in rest:
            yield chunk
    except httpx.TransportError as error:
        replica.mark_failed(_describe(error))
        message = f"the replica serving this request failed mid-stream ({replica.url}: {_describe(error)})"
        body = {"error": {"message": message, "type": "server_error", "param": None, "code": "502"}}
        yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
    finally:
        replica.in_flight -= 1
        await upstream.aclose()


def _describe(error: Exception) -> str:
    return str(error) or type(error).__name__
