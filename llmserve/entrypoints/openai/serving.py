"""What the completion and chat handlers share: errors, admission, engine streams, logprob text.

The handlers never hold engine state: each HTTP request becomes one engine request per prompt
(`AsyncLLM.generate`), and closing those iterators (client gone, server stopping) aborts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from llmserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineFailedError, RequestFailedError
from llmserve.engine.llm_engine import check_params
from llmserve.entrypoints.openai.admission import Admission, Refused
from llmserve.entrypoints.openai.chat_options import ChatOptions
from llmserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, UsageInfo, _SamplingRequest
from llmserve.outputs import CompletionOutput, RequestOutput, SpecDecodeStats
from llmserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("llmserve.server")

DISCONNECT_POLL_SECONDS = 0.25
MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clients expect a finite number

T = TypeVar("T")


class ApiError(Exception):
    """An error with an HTTP status and an OpenAI error body; `param` names the offending field."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",  # noqa: A002 - the OpenAI field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = escape_surrogates(message)  # a message quoting user text must still encode as JSON
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )


def escape_surrogates(text: str) -> str:
    """`text` with each lone UTF-16 surrogate as a backslash escape, which UTF-8 (and JSON) can carry."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


@dataclass
class ServerContext:
    """Per-app state the handlers share."""

    engine: AsyncLLM
    served_model_name: str
    max_in_flight: int
    in_flight: int = 0
    admission: Admission | None = None  # deadline and queued-token bounds (admission.py)
    grammar_compiler: Any = None  # structured outputs: made on first use (structured_outputs.py)
    chat_options: ChatOptions = field(default_factory=ChatOptions)  # template override, output parsers

    @property
    def max_model_len(self) -> int:
        return self.engine.config.model.max_model_len

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters served over the model (`--lora-modules` and those loaded since), by name."""
        return self.engine.lora.names

    def model_name(self, requested: str | None) -> str:
        """The `model` a response reports: the LoRA adapter the request named, else the served model."""
        return requested if requested is not None and requested in self.lora_names else self.served_model_name

    def check_model(self, model: str | None, adapters: bool = True) -> None:
        """404 unless `model` is the served model or (where `adapters`) one of its LoRA adapters."""
        if model is None or model == self.served_model_name or (adapters and model in self.lora_names):
            return
        served = ", ".join(repr(name) for name in (self.served_model_name, *self.lora_names))
        raise ApiError(
            f"the model {model!r} does not exist; this server serves {served}",
            status=404,
            type="not_found_error",
            param="model",
            code="model_not_found",
        )

    def admit(
        self,
        count: int,
        prompt_tokens: Sequence[int] = (),
        timeout: float | None = None,
        max_tokens: int = 0,
    ) -> Callable[[], None]:
        """Take `count` in-flight slots or refuse with 429; returns the (idempotent) release.
        `prompt_tokens` (each prompt's length) and `timeout` are checked by the admission policy."""
        if count > self.max_in_flight:
            raise ApiError(
                f"the request has {count} prompts but the server admits at most {self.max_in_flight} "
                "requests at once",
                param="prompt",
            )
        if self.in_flight + count > self.max_in_flight:
            raise ApiError(
                f"the server is at its limit of {self.max_in_flight} requests in flight; retry later",
                status=429,
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        if self.admission is not None:
            try:
                self.admission.check(prompt_tokens, timeout, self.in_flight, max_tokens)
            except Refused as refused:
                raise ApiError(
                    str(refused),
                    status=429,
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(refused.retry_after)},
                ) from None
        self.in_flight += count
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= count

        return release

    @staticmethod
    def new_request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def encode_prompt(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        try:
            return self.engine.encode_prompt(prompt)
        except ValueError as error:
            raise ApiError(str(error), param=param) from error

    def encode_text(self, text: str, param: str = "prompt") -> list[int]:
        """Token ids of any text, unchecked against the context (/tokenize counts long texts too)."""
        try:
            return self.engine.tokenizer.encode(text)
        except ValueError as error:
            raise ApiError(str(error), param=param) from error

    def sampling_params(
        self, request: _SamplingRequest, prompt_lens: Sequence[int], default_max: int | None
    ) -> SamplingParams:
        """Engine parameters with max_tokens checked against the context left by the longest prompt."""
        room = self.max_model_len - max(prompt_lens)
        requested = request.requested_max_tokens()
        max_tokens = requested if requested is not None else min(default_max or room, room)
        if max_tokens > room:
            raise ApiError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{max(prompt_lens)} prompt tokens plus max_tokens={max_tokens} exceed it; "
                "shorten the prompt or lower max_tokens",
                param=request.max_tokens_param,
            )
        try:
            params = request.to_sampling_params(max_tokens)
            model = getattr(request, "model", None)  # /v1/generate has no model field
            if model is not None and model in self.lora_names:  # the request runs under that adapter
                params = dataclasses.replace(params, lora_name=model)
            check_params(params, self.engine.config)
        except ValueError as error:  # SamplingParams messages start with the field's name
            raise ApiError(str(error), param=str(error).split(" ", 1)[0]) from error
        return params


# -- engine streams ---------------------------------------------------------------------------------


async def merge_streams(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several engine streams as (stream index, item); closing this closes them all."""
    if len(streams) == 1:  # the usual case: no pump task and no second queue hop per output
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except Exception as error:  # noqa: BLE001 - re-raised in the consumer
            queue.put_nowait((index, error))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


class EngineRequests:
    """The engine requests behind one HTTP request (one per prompt), iterated, aborted and logged together.

    A stream gets each request's outputs as deltas, a plain response only its final output."""

    def __init__(
        self,
        engine: AsyncLLM,
        request_id: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        priority: int = 0,
        stream: bool = False,
        timeout: float | None = None,
    ) -> None:
        self.id = request_id
        self.timeout = timeout
        self.timed_out = False
        self.request_ids = [
            request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))
        ]
        self.prompts = list(prompts)
        self.latest: list[RequestOutput | None] = [None] * len(prompts)
        self.num_generated = [0] * len(prompts)  # tokens so far, over the prompt's n completions
        self.finish_reasons: list[set[str]] = [set() for _ in prompts]
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        params = params.with_output_kind(kind)
        self._streams = [
            engine.generate(ids, params, rid, priority)
            for ids, rid in zip(prompts, self.request_ids, strict=True)
        ]
        self._engine = engine
        self._timer: asyncio.TimerHandle | None = None
        if timeout is not None:
            self._timer = asyncio.get_running_loop().call_later(timeout, self._expire)

    def _expire(self) -> None:
        """The request's timeout passed: abort what still runs (its KV blocks are freed at once)."""
        self.timed_out = True
        for request_id in self.request_ids:
            self._engine.abort(request_id)

    def _timeout_error(self) -> ApiError:
        return ApiError(
            f"the request did not finish within its timeout of {self.timeout:g} s and was aborted",
            status=408,
            type="timeout_error",
            param="timeout",
            code="timeout",
        )

    async def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Yield (prompt index, output); engine failures raise; each request is logged."""
        try:
            async for index, output in merge_streams(self._streams):
                if self.timed_out:
                    raise self._timeout_error()
                if output.error is not None:
                    raise RuntimeError(f"request {output.request_id} failed: {output.error}")
                self.latest[index] = output
                self.num_generated[index] += sum(len(c.token_ids) for c in output.outputs)
                self.finish_reasons[index].update(c.finish_reason for c in output.outputs if c.finish_reason)
                yield index, output
        finally:
            if self._timer is not None:
                self._timer.cancel()
            for index, request_id in enumerate(self.request_ids):
                log_finished(
                    request_id, self.latest[index], self.num_generated[index], self.finish_reasons[index]
                )

    async def final(self) -> list[RequestOutput]:
        """Run every request to its finished output, in prompt order."""
        async with contextlib.aclosing(self.outputs()) as outputs:
            async for _ in outputs:
                pass
        return [output for output in self.latest if output is not None]

    def usage(self) -> UsageInfo:
        """Every prompt once (and its prefix-cache hit once), plus the tokens of all its completions so
        far (summed over n), and the speculative decoding counts of all of them."""
        outputs = [o for o in self.latest if o is not None]
        cached = sum(o.num_cached_tokens for o in outputs)
        speculative = sum((o.spec_decode for o in outputs if o.spec_decode), SpecDecodeStats())
        return UsageInfo.of(sum(map(len, self.prompts)), sum(self.num_generated), cached, speculative)


@dataclass
class Delta:
    """What one choice gained since the last chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass
class ChoiceProgress:
    """Whether a choice has finished, so that a stream sends its finish once and ends open choices."""

    finished: bool = False

    def advance(self, completion: CompletionOutput, with_logprobs: bool) -> Delta | None:
        """A chunk's content from a completion's delta (or a whole final completion), or None when there
        is nothing worth a chunk (tokens without text: held back or mid-character)."""
        if self.finished:
            return None
        finish = completion.finish_reason
        if not completion.text and finish is None and not (with_logprobs and completion.token_ids):
            return None
        self.finished = finish is not None
        return Delta(completion.text, list(completion.token_ids), completion.logprobs, finish)


async def until_disconnected(raw_request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await raw_request.is_disconnected():
                raise ClientDisconnected
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however the stream ends.

    The body generator's own `finally` does not run if it was never started (the client left before
    the first byte), so resources held for the stream are released here instead.
    """

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._content.aclose()  # a disconnect can leave it suspended at a yield
            finally:
                self._on_close()


def json_response(body: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        body.model_dump_json(), status_code=status, headers=headers, media_type="application/json"
    )


def sse_event(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = sse_event("[DONE]")


def sse_error(error: BaseException) -> str:
    """The in-band error event for a stream that already sent its 200 status."""
    if isinstance(error, ApiError):
        message, status = error.message, error.status
    elif isinstance(error, (EngineDeadError, EngineFailedError)):  # the server's state, as on /health
        message, status = str(error), 503
    elif isinstance(error, RequestFailedError):  # the engine's message names no internals
        message, status = str(error), 500
    else:  # a bug: its text may hold paths or class names, which stay in the log
        logger.error("internal error in a stream", exc_info=error)
        message, status = "internal server error", 500
    kind = "invalid_request_error" if status < 500 else "server_error"
    return sse_event(
        ErrorResponse(error=ErrorInfo(message=message, type=kind, code=str(status))).model_dump_json()
    )


# -- logprobs ---------------------------------------------------------------------------------------


class TokenText:
    """Per-token strings and bytes for logprobs: each token decoded alone, as OpenAI reports them."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < _TOKEN_CACHE_SIZE:
                self._cache[token_id] = text
        return text

    def bytes_of(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes; exact even for a token holding part of a character."""
        text = self(token_id)
        if _REPLACEMENT_CHAR in text and hasattr(self._tokenizer, "convert_ids_to_tokens"):
            raw = raw_token_bytes(self._tokenizer.convert_ids_to_tokens([token_id])[0])
            if raw is not None:
                return list(raw)
        return list(text.encode("utf-8"))


_TOKEN_CACHE_SIZE = 1 << 16
_REPLACEMENT_CHAR = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for bytes (GPT-2's table): unicode char -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


_BYTE_LEVEL = _byte_level_alphabet()


def raw_token_bytes(piece: str) -> bytes | None:
    """Bytes of a vocabulary piece: SentencePiece byte fallback (<0xE2>) or byte-level BPE; else None."""
    match = _BYTE_FALLBACK.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    if all(char in _BYTE_LEVEL for char in piece):
        return bytes(_BYTE_LEVEL[char] for char in piece)
    return None


def finite(logprob: float) -> float:
    return logprob if not math.isnan(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


def top_entries(entry: dict[int, float], count: int) -> list[tuple[int, float]]:
    """The `count` most likely of one token's (top-N plus sampled) logprob entries."""
    return sorted(entry.items(), key=lambda item: item[1], reverse=True)[:count]


# -- logging ----------------------------------------------------------------------------------------


def log_finished(request_id: str, output: RequestOutput | None, num_tokens: int, reasons: set[str]) -> None:
    """One line per engine request: tokens, TTFT, end-to-end latency and why it ended."""
    if output is None:
        logger.info("request %s ended before its first token", request_id)
        return
    metrics = output.metrics
    ttft = metrics.time_to_first_token if metrics else None
    e2e = (metrics.e2e_latency or time.monotonic() - metrics.arrival_time) if metrics else None
    logger.info(
        "request %s %s: prompt %d tokens, output %d tokens, ttft %s, e2e %s, finish %s",
        request_id,
        "finished" if output.finished else "aborted",
        len(output.prompt_token_ids),
        num_tokens,
        _seconds(ttft),
        _seconds(e2e),
        ",".join(sorted(reasons)) or "abort",
    )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"
