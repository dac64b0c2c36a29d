"""The OpenAI-compatible HTTP server: a FastAPI app over one `AsyncLLM`, run by uvicorn.

Every error a client can cause is a 4xx with OpenAI's body `{"error": {message, type, param, code}}`;
an internal failure is a 500 with the same body and never a traceback. serve.py binds the port before
the model loads (a busy port fails at once) and answers 503 `starting` there until uvicorn takes it
over; /health is 200 once the engine is warmed up (health.py). SIGTERM or Ctrl-C stops the engine,
which ends every in-flight request (streams get a final chunk with finish_reason "abort"), then
uvicorn drains the connections and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pydantic
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineFailedError, RequestFailedError
from llmserve.entrypoints.openai.admission import Admission, AdmissionConfig
from llmserve.entrypoints.openai.chat_options import ChatOptions
from llmserve.entrypoints.openai.health import health_of
from llmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    GenerateRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    ResponsesRequest,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from llmserve.entrypoints.openai.server_info import server_info
from llmserve.entrypoints.openai.serving import ApiError, ClientDisconnected, ServerContext, json_response
from llmserve.entrypoints.openai.serving_chat import ChatHandler
from llmserve.entrypoints.openai.serving_completions import CompletionHandler
from llmserve.entrypoints.openai.serving_embeddings import EmbeddingHandler
from llmserve.entrypoints.openai.serving_generate import GenerateHandler
from llmserve.entrypoints.openai.serving_responses import ResponsesHandler
from llmserve.entrypoints.openai.web import routes as web_routes
from llmserve.metrics.prometheus import PrometheusMetrics
from llmserve.metrics.reliability import health_counters
from llmserve.model_loader.hf_cache import model_id

logger = logging.getLogger("llmserve.server")

MAX_BODY_BYTES = 4 * 2**20
STATS_LOG_SECONDS = 10.0
GRACEFUL_SHUTDOWN_SECONDS = 10
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)  # .Q4_1, -Q4_K_M, .f16


@dataclass
class AppState:
    ctx: ServerContext
    completions: CompletionHandler
    chat: ChatHandler
    metrics: PrometheusMetrics
    embeddings: EmbeddingHandler | None = None
    responses: ResponsesHandler | None = None
    generate: GenerateHandler | None = None


def build_app(
    engine: AsyncLLM,
    served_model_name: str,
    api_key: str | None = None,
    max_concurrent_requests: int = 256,
    max_body_bytes: int = MAX_BODY_BYTES,
    metrics: PrometheusMetrics | None = None,
    admission: AdmissionConfig | None = None,
    chat_options: ChatOptions | None = None,
) -> FastAPI:
    """The app; `max_concurrent_requests` bounds the engine requests in flight (running + waiting)
    before 429s."""
    if max_concurrent_requests < 1:
        raise ValueError(f"max_concurrent_requests must be >= 1, got {max_concurrent_requests}")
    metrics = metrics or PrometheusMetrics()
    metrics.model_name = metrics.model_name or served_model_name
    metrics.attach(engine)
    metrics.registry.register(health_counters(engine))
    ctx = ServerContext(
        engine,
        served_model_name,
        max_concurrent_requests,
        admission=Admission(engine, admission or AdmissionConfig()),
        chat_options=chat_options or ChatOptions(),
    )
    app = FastAPI(title="llmserve", lifespan=_lifespan, strict_content_type=False)
    app.state.llmserve = AppState(ctx, CompletionHandler(ctx), ChatHandler(ctx), metrics)
    app.state.api_key_required = bool(api_key)  # the playground asks for a key only then (web.py)
    app.state.llmserve.embeddings = EmbeddingHandler(ctx)
    app.state.llmserve.responses = ResponsesHandler(ctx, app.state.llmserve.chat)
    app.state.llmserve.generate = GenerateHandler(ctx)
    app.include_router(router)
    app.include_router(web_routes)  # the playground, the dashboard and the JSON metrics (web.py)
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)  # added last: runs first
    return app


# -- routes -----------------------------------------------------------------------------------------

router = APIRouter()


def _state(raw_request: Request) -> AppState:
    return raw_request.app.state.llmserve


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    return await _state(raw_request).completions.create(request, raw_request)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    return await _state(raw_request).chat.create(request, raw_request)


@router.post("/v1/embeddings")
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    return await _state(raw_request).embeddings.create(request, raw_request)


@router.post("/v1/responses")
async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
    return await _state(raw_request).responses.create(request, raw_request)


@router.post("/v1/generate")
async def generate(request: GenerateRequest, raw_request: Request) -> Response:
    return await _state(raw_request).generate.create(request, raw_request)


@router.get("/v1/models")
async def list_models(raw_request: Request) -> Response:
    ctx = _state(raw_request).ctx
    base = ModelCard(id=ctx.served_model_name, root=ctx.served_model_name, max_model_len=ctx.max_model_len)
    adapters = [
        ModelCard(id=name, root=path, parent=ctx.served_model_name, max_model_len=ctx.max_model_len)
        for name, path in ctx.engine.lora.adapters.items()
    ]
    return json_response(ModelList(data=[base, *adapters]))


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    """Load a LoRA adapter while serving (vLLM's route; docs/lora.md)."""
    ctx = _state(raw_request).ctx
    if request.lora_name == ctx.served_model_name:
        raise ApiError(f"{request.lora_name!r} is the served model's name", param="lora_name")
    try:
        await ctx.engine.lora.load(request.lora_name, request.lora_path)
    except ValueError as error:
        raise ApiError(str(error), param="lora_path") from None
    return Response(
        f"Success: LoRA adapter '{request.lora_name}' added successfully.", media_type="text/plain"
    )


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    """Unload a LoRA adapter no unfinished request uses (vLLM's route)."""
    ctx = _state(raw_request).ctx
    if request.lora_name not in ctx.engine.lora.adapters:
        raise ApiError(
            f"the LoRA adapter {request.lora_name!r} does not exist",
            status=404,
            type="not_found_error",
            param="lora_name",
            code="model_not_found",
        )
    try:
        await ctx.engine.lora.unload(request.lora_name)
    except ValueError as error:
        raise ApiError(str(error), param="lora_name") from None
    return Response(
        f"Success: LoRA adapter '{request.lora_name}' removed successfully.", media_type="text/plain"
    )


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    state = _state(raw_request)
    state.ctx.check_model(request.model)
    if request.messages is not None:
        messages = [m.to_template_message() for m in request.messages]
        tokens = state.chat.render(messages, request.add_generation_prompt)
    else:
        tokens = state.ctx.encode_text(request.prompt or "")
    return json_response(
        TokenizeResponse(count=len(tokens), max_model_len=state.ctx.max_model_len, tokens=tokens)
    )


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    ctx = _state(raw_request).ctx
    ctx.check_model(request.model)
    vocab_size = ctx.engine.config.model.arch.vocab_size
    if any(not 0 <= token < vocab_size for token in request.tokens):
        raise ApiError(f"token ids must be in [0, {vocab_size})", param="tokens")
    text = ctx.engine.tokenizer.decode(request.tokens, skip_special_tokens=False)
    return json_response(DetokenizeResponse(prompt=text))


@router.get("/health")
async def health(raw_request: Request) -> Response:
    """200 only while the engine and every tensor-parallel rank of it can serve (health.py)."""
    body, status = health_of(_state(raw_request).ctx.engine)
    return Response(
        body.model_dump_json(exclude_none=True), status_code=status, media_type="application/json"
    )


@router.get("/server_info")
async def get_server_info(raw_request: Request) -> Response:
    """Block size, hash scheme, tokenizer and KV-events endpoints, for a router, and the model's
    memory (server_info.py)."""
    ctx = _state(raw_request).ctx
    engine = ctx.engine
    invariance = getattr(engine, "batch_invariance", None)
    keys = engine.lora.cache_keys()
    return json_response(
        server_info(ctx.served_model_name, engine.config, engine.tokenizer, engine.memory, invariance, keys)
    )


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    registry = _state(raw_request).metrics
    return Response(registry.render(), media_type=registry.content_type)


# -- errors, auth, lifespan --------------------------------------------------------------------------


def _error_type(status: int) -> str:
    return {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )


def _install_error_handlers(app: FastAPI) -> None:
    """Every failure becomes an OpenAI error body; the status says whose fault it was."""

    async def on_internal_error(raw_request: Request, error: Exception) -> Response:
        logger.error("internal error serving %s", raw_request.url.path, exc_info=error)
        body = ApiError("internal server error", status=500, type="server_error").body()
        return json_response(body, 500)

    async def on_api_error(_: Request, error: ApiError) -> Response:
        return json_response(error.body(), error.status, error.headers)

    async def on_validation_error(_: Request, error: RequestValidationError) -> Response:
        return json_response(validation_api_error(error).body(), 400)

    async def on_http_error(_: Request, error: StarletteHTTPException) -> Response:
        api_error = ApiError(str(error.detail), status=error.status_code, type=_error_type(error.status_code))
        return json_response(api_error.body(), error.status_code, error.headers)

    async def on_value_error(raw_request: Request, error: ValueError) -> Response:
        if isinstance(error, pydantic.ValidationError):  # a response model we built is wrong: our bug
            return await on_internal_error(raw_request, error)
        return json_response(ApiError(str(error)).body(), 400)

    async def on_engine_dead(_: Request, error: EngineDeadError | EngineFailedError) -> Response:
        return json_response(ApiError(str(error), status=503, type="server_error").body(), 503)

    async def on_request_failed(_: Request, error: RequestFailedError) -> Response:
        return json_response(ApiError(str(error), status=500, type="server_error").body(), 500)

    async def on_disconnect(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody is listening; the engine requests are already aborted

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ValueError, on_value_error)
    app.add_exception_handler(EngineDeadError, on_engine_dead)
    app.add_exception_handler(EngineFailedError, on_engine_dead)
    app.add_exception_handler(RequestFailedError, on_request_failed)
    app.add_exception_handler(ClientDisconnected, on_disconnect)
    app.add_exception_handler(Exception, on_internal_error)


def validation_api_error(error: RequestValidationError) -> ApiError:
    """The most specific validation error as a 400 whose `param` is the top-level field at fault.

    For a union field pydantic reports one error per member; the deepest one is from the member the
    input came closest to matching, so it is the one worth showing.
    """
    chosen = max(error.errors(), key=lambda e: len(e["loc"]))
    if chosen["type"] == "json_invalid":
        detail = chosen.get("ctx", {}).get("error", "")
        return ApiError(f"the request body is not valid JSON: {detail}".rstrip(": "))
    loc = [str(part) for part in chosen["loc"][1:] if not _is_union_tag(part)]
    message = str(chosen["msg"]).removeprefix("Value error, ")
    if not loc:
        return ApiError("the request body must be a JSON object (sent with Content-Type: application/json)")
    return ApiError(f"{'.'.join(loc)}: {message}", param=loc[0])


def _is_union_tag(part: str | int) -> bool:
    """pydantic names the union member it tried ('str', 'list[int]') in an error's location."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on the API routes; /health, /metrics and /server_info
    stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_protected(scope["path"]) and not self._authorized(scope):
            error = ApiError(
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                status=401,
                type="authentication_error",
                code="invalid_api_key",
            )
            await json_response(error.body(), 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        return secrets.compare_digest(header, self._expected)


class BodySizeLimitMiddleware:
    """Refuses request bodies over `max_bytes` with 413, by Content-Length or while reading a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await json_response(self._error().body(), 413)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # an HTTPException passes FastAPI's body reader unchanged
                raise StarletteHTTPException(413, self._error().message)
            return message

        await self.app(scope, limited_receive, send)

    def _error(self) -> ApiError:
        return ApiError(f"the request body exceeds {self.max_bytes} bytes", status=413)


def _is_protected(path: str) -> bool:
    return path == "/v1" or any(path.startswith(prefix) for prefix in _PROTECTED_PREFIXES)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    task = asyncio.create_task(_log_stats_periodically(app.state.llmserve))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _log_stats_periodically(state: AppState, interval: float = STATS_LOG_SECONDS) -> None:
    """Every `interval` seconds while busy: queue sizes, KV usage and token throughput."""
    metrics, engine = state.metrics, state.ctx.engine
    last = (metrics.total_prompt_tokens, metrics.total_generation_tokens, time.monotonic())
    while True:
        await asyncio.sleep(interval)
        now = (metrics.total_prompt_tokens, metrics.total_generation_tokens, time.monotonic())
        gauges = engine.gauges
        running, waiting = gauges.num_running, gauges.num_waiting
        if running or waiting or now[:2] != last[:2]:
            elapsed = now[2] - last[2]
            logger.info(
                "running: %d, waiting: %d, KV cache usage: %.1f%%, "
                "prompt: %.1f tokens/s, generation: %.1f tokens/s",
                running,
                waiting,
                100 * gauges.kv_cache_usage,
                (now[0] - last[0]) / elapsed,
                (now[1] - last[1]) / elapsed,
            )
        last = now


# -- running -----------------------------------------------------------------------------------------


def default_served_model_name(model_path: str) -> str:
    """The model directory's name (`org/name` for the HF cache's), or the GGUF file's stem without its
    quantization tag.

    `SmolLM2-135M-Instruct.Q4_1.gguf` is served as `SmolLM2-135M-Instruct`: clients name the model,
    not the file it happens to be quantized into.
    """
    path = Path(model_path.rstrip("/"))
    if not path.is_file():
        return model_id(str(path)) or path.name  # a snapshot of the HF cache: its org/name
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


class UvicornServer(uvicorn.Server):
    """uvicorn with a hook on the first exit signal, and no re-raising of it afterwards.

    uvicorn re-raises a caught SIGTERM once it has shut down, which would kill the process with
    status -15; a graceful shutdown is a success, so the process returns normally instead.
    `drain_seconds`: how long to go on answering (/health 503 `stopping`, requests 503) before the
    listener closes, so that a load balancer sees the server leave rather than refuse connections.
    """

    def __init__(
        self, config: uvicorn.Config, on_exit: Callable[[], None], drain_seconds: float = 0.0
    ) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._drain_seconds = drain_seconds

    async def shutdown(self, sockets=None) -> None:
        if self._drain_seconds > 0:
            logger.info("draining for %.1f s before closing the listener", self._drain_seconds)
            await asyncio.sleep(self._drain_seconds)
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            self._on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
