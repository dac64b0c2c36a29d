"""The router's HTTP front: every route a replica serves, behind one address.

Each POST route of a replica (api_server.py) is forwarded, streams included: those with a prompt to
the replica caching most of it (policy.py), the others to the least loaded. The router answers the
rest itself, from all the replicas: /health (every replica's), /metrics and /v1/metrics (its own and
every replica's series), /v1/models and /server_info (the replicas', which registration found
identical; /server_info names no KV-event endpoints, since the router publishes none), and the
playground and dashboard pages (web.py's files; the dashboard's series summed over the replicas).
A test holds the router's routes to the replica's.

`build_router` registers the replicas (every check a one-line ValueError), subscribes to their KV
events and returns the app; `run_router` serves it with uvicorn on a socket bound beforehand.
Errors the router itself gives (no replica left, a body too large) have OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from llmserve.config.router import RouterConfig
from llmserve.entrypoints.openai import web
from llmserve.entrypoints.openai.api_server import ApiKeyMiddleware, UvicornServer
from llmserve.entrypoints.openai.server_info import ServerInfo, tokenizer_fingerprint
from llmserve.metrics.history import MetricsHistory
from llmserve.metrics.summary import summary
from llmserve.model_loader.default_model import resolve_model_path
from llmserve.model_loader.tokenizer import Tokenizer, load_tokenizer
from llmserve.router.disaggregation import PrefillStage
from llmserve.router.events import KVEventSubscriber
from llmserve.router.index import PrefixIndex
from llmserve.router.metrics import RouterMetrics, merged_scrape
from llmserve.router.policy import RoutingPolicy
from llmserve.router.prompt import PromptHasher
from llmserve.router.proxy import FORWARDED_HEADERS, NoReplicaError, Proxy
from llmserve.router.replica import HealthChecker, Replica, check_compatible, fetch_info, wait_for_info

logger = logging.getLogger("llmserve.router")

MAX_BODY_BYTES = 4 * 2**20


@dataclass
class RouterState:
    replicas: list[Replica]
    hasher: PromptHasher
    proxy: Proxy
    index: PrefixIndex
    subscriber: KVEventSubscriber
    health: HealthChecker
    metrics: RouterMetrics
    history: MetricsHistory  # the dashboard's series, of the replicas' summed metrics
    api_key: str | None = None  # the router checks it and sends it on to the replicas
    # the replicas' LoRA adapters' prefix-cache keys by name (their /server_info), read at registration
    # and after each load or unload the router passes on; an adapter loaded on a replica directly is
    # hashed as the base model's request (a cache miss where it lands, never a wrong answer)
    lora_keys: dict[str, bytes] = field(default_factory=dict)
    prefill: PrefillStage | None = None  # prefill/decode disaggregation; None: replicas serve whole requests

    def upstream_headers(self, raw_request: Request) -> dict[str, str]:
        """The client's headers a replica needs, with the router's API key where it has one."""
        headers = {k: v for k, v in raw_request.headers.items() if k in FORWARDED_HEADERS}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        return headers


def load_router_tokenizer(config: RouterConfig) -> Tokenizer:
    """The replicas' tokenizer with its chat template, to hash prompts as they will."""
    tokenizer = load_tokenizer(resolve_model_path(config.model))
    tokenizer.load_chat_template()
    return tokenizer


async def build_router(config: RouterConfig, tokenizer: Tokenizer | None = None) -> FastAPI:
    """Register every replica (ValueError if one is unreachable or incompatible) and build the app."""
    tokenizer = tokenizer or load_router_tokenizer(config)
    async with httpx.AsyncClient() as registration:  # this loop ends here; uvicorn runs another
        replicas, prefill = await _register(registration, config, tokenizer_fingerprint(tokenizer))
    client = httpx.AsyncClient(  # generation has no read timeout: a long answer is not a failure
        timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
    )
    index = PrefixIndex([r.url for r in replicas], config.pending_prefix_seconds)
    subscriber = KVEventSubscriber(index)
    for replica in replicas:
        events = replica.info.kv_events
        subscriber.add(replica.url, events.endpoint, events.replay_endpoint, events.topic)
    metrics = RouterMetrics(replicas)
    state = RouterState(
        replicas=replicas,
        hasher=PromptHasher(tokenizer, replicas[0].info.block_size),
        proxy=Proxy(client, replicas, RoutingPolicy(index, config.max_imbalance), metrics.on_routed),
        index=index,
        subscriber=subscriber,
        health=HealthChecker(client, replicas + prefill, config.health_interval_seconds),
        metrics=metrics,
        history=MetricsHistory(lambda: merged_scrape(replicas)),
        api_key=config.api_key,
        lora_keys=agreed_lora_keys([r.info for r in replicas]),
        prefill=PrefillStage(client, prefill, config.prefill_timeout_seconds, metrics.on_prefill)
        if prefill
        else None,
    )
    app = FastAPI(title="llmserve router", lifespan=_lifespan)
    app.state.router = state
    app.include_router(routes)
    _install_error_handlers(app)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)  # as `llmserve serve --api-key`
    return app


async def _register(
    client: httpx.AsyncClient, config: RouterConfig, fingerprint: str
) -> tuple[list[Replica], list[Replica]]:
    """Every replica and prefill instance, checked against the first replica's model and block size and
    the router's tokenizer; with prefill instances, each side's role (--kv-transfer-config)."""
    timeout = config.register_timeout_seconds
    urls = config.replicas + config.prefill_replicas
    infos = await asyncio.gather(*(wait_for_info(client, url, timeout) for url in urls))
    expected = infos[0].model_copy(update={"tokenizer_fingerprint": fingerprint})
    replicas = [Replica(url, info) for url, info in zip(urls, infos, strict=True)]
    decode, prefill = replicas[: len(config.replicas)], replicas[len(config.replicas) :]
    for replica in decode:
        check_compatible(replica.url, replica.info, expected)
    for replica in prefill:
        prefill_expected = expected.model_copy(update={"kv_role": replica.info.kv_role})
        check_compatible(replica.url, replica.info, prefill_expected, needs_events=False)
    if prefill:
        _check_roles(decode, ("kv_consumer", "kv_both"), "--replica (a decode instance)")
        _check_roles(prefill, ("kv_producer", "kv_both"), "--prefill-replica")
    return decode, prefill


def _check_roles(replicas: list[Replica], roles: tuple[str, ...], flag: str) -> None:
    for replica in replicas:
        if replica.info.kv_role not in roles:
            raise ValueError(
                f"{flag} {replica.url} has kv_role {replica.info.kv_role!r}; start it with "
                f"--kv-transfer-config and a kv_role of {' or '.join(roles)}"
            )


# -- routes -----------------------------------------------------------------------------------------

routes = APIRouter()


def _state(raw_request: Request) -> RouterState:
    return raw_request.app.state.router


# every POST route of a replica (api_server.py); the prompt's routes are PromptHasher's
@routes.post("/v1/completions")
@routes.post("/v1/chat/completions")
@routes.post("/v1/responses")
@routes.post("/v1/generate")
@routes.post("/v1/embeddings")
@routes.post("/tokenize")
@routes.post("/detokenize")
async def forward(raw_request: Request) -> Response:
    async def send(state: RouterState, body: bytes) -> Response:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the replica answers with the precise 400
        path = raw_request.url.path
        hashes = await asyncio.to_thread(state.hasher.hashes, path, parsed, state.lora_keys)
        stream = isinstance(parsed, dict) and parsed.get("stream") is True
        headers = state.upstream_headers(raw_request)
        if state.prefill is not None:  # the prompt's blocks to a decode instance first
            await state.prefill.run(path, parsed, headers)
        return await state.proxy.forward(path, body, headers, hashes, stream)

    return await _pass_on(raw_request, send)


@routes.post("/v1/load_lora_adapter")
@routes.post("/v1/unload_lora_adapter")
async def broadcast(raw_request: Request) -> Response:
    """Run-time LoRA loading and unloading reach every replica (vLLM's routes, api_server.py)."""

    async def send(state: RouterState, body: bytes) -> Response:
        headers = state.upstream_headers(raw_request)
        response = await state.proxy.broadcast(raw_request.url.path, body, headers)
        if response.status_code == 200:
            await _refresh_lora_keys(state)
        return response

    return await _pass_on(raw_request, send)


def agreed_lora_keys(infos: list[ServerInfo]) -> dict[str, bytes]:
    """The adapters' prefix-cache keys by name where every replica that serves the name agrees."""
    keys: dict[str, bytes] = {}
    conflicting: set[str] = set()
    for info in infos:
        for name, key in info.lora_cache_keys.items():
            if keys.setdefault(name, bytes.fromhex(key)) != bytes.fromhex(key):
                conflicting.add(name)
    return {name: key for name, key in keys.items() if name not in conflicting}


async def _refresh_lora_keys(state: RouterState) -> None:
    """The adapters' keys again from the healthy replicas (a load or unload just reached them)."""
    infos = []
    for replica in (r for r in state.replicas if r.healthy):
        try:
            infos.append(await fetch_info(state.proxy.client, replica.url))
        except (httpx.TransportError, ValueError) as error:
            logger.warning("LoRA keys: replica %s's /server_info failed (%s)", replica.url, error)
    state.lora_keys = agreed_lora_keys(infos)


Sender = Callable[[RouterState, bytes], Awaitable[Response]]


async def _pass_on(raw_request: Request, send: Sender) -> Response:
    """The request's body passed on by `send`: too large is a 413, no replica able to take it a 503."""
    body = await raw_request.body()
    if len(body) > MAX_BODY_BYTES:
        return error_response(f"the request body exceeds {MAX_BODY_BYTES} bytes", 413)
    try:
        return await send(_state(raw_request), body)
    except NoReplicaError as error:
        return error_response(error.message, 503)


@routes.get("/v1/models")
async def list_models(raw_request: Request) -> Response:
    state = _state(raw_request)
    headers = state.upstream_headers(raw_request)
    for replica in (r for r in state.replicas if r.healthy):
        try:
            upstream = await state.proxy.client.get(f"{replica.url}/v1/models", headers=headers)
        except httpx.TransportError as error:
            replica.mark_failed(str(error) or type(error).__name__)
            continue
        return Response(
            upstream.content, upstream.status_code, media_type=upstream.headers.get("content-type")
        )
    return error_response("no replica is healthy", 503)


@routes.get("/server_info")
async def server_info(raw_request: Request) -> Response:
    """The replicas' model, context and block size (one for all), without KV-event endpoints: a
    router publishes none, so another router refuses it as a replica; the adapters' keys it holds."""
    state = _state(raw_request)
    keys = {name: key.hex() for name, key in state.lora_keys.items()}
    info = state.replicas[0].info.model_copy(update={"kv_events": None, "lora_cache_keys": keys})
    return Response(info.model_dump_json(), media_type="application/json")


@routes.get("/playground/config")
async def playground_config(raw_request: Request) -> Response:
    return JSONResponse({"api_key_required": bool(_state(raw_request).api_key)})


@routes.get("/dashboard/stats")
async def dashboard_stats(raw_request: Request) -> Response:
    """A server's dashboard series (web.py), of the healthy replicas' metrics summed."""
    state = _state(raw_request)
    await state.health.read_all_metrics()
    return JSONResponse(
        {
            "model": state.replicas[0].info.model,
            "summary": summary(merged_scrape(state.replicas)),
            "points": state.history.points(),
        }
    )


# the pages and their files, as a server serves them
routes.add_api_route("/", web.playground, methods=["GET"], include_in_schema=False)
routes.add_api_route("/dashboard", web.dashboard, methods=["GET"], include_in_schema=False)
routes.add_api_route("/static/{name}", web.asset, methods=["GET"], include_in_schema=False)


@routes.get("/health")
async def health(raw_request: Request) -> Response:
    """200 only when every replica is healthy; else 503 naming the ones that are not."""
    down = [f"{r.url} ({r.last_error})" for r in _state(raw_request).replicas if not r.healthy]
    if down:
        return error_response(f"replicas not ready: {', '.join(down)}", 503)
    return Response(status_code=200)


@routes.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    """The router's own series and every healthy replica's, read now, with a `replica` label."""
    state = _state(raw_request)
    await state.health.read_all_metrics()
    return Response(state.metrics.render(state.replicas, state.index), media_type=CONTENT_TYPE_LATEST)


@routes.get("/v1/metrics")
async def metrics_json(raw_request: Request) -> Response:
    """The same numbers as JSON: the router's, each replica's, and their sums."""
    state = _state(raw_request)
    await state.health.read_all_metrics()
    return JSONResponse(state.metrics.snapshot(state.replicas, state.index))


def error_response(message: str, status: int) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


def _install_error_handlers(app: FastAPI) -> None:
    async def on_http_error(_: Request, error: StarletteHTTPException) -> Response:
        return error_response(str(error.detail), error.status_code)

    async def on_internal_error(raw_request: Request, error: Exception) -> Response:
        logger.error("internal error routing %s", raw_request.url.path, exc_info=error)
        return error_response("internal router error", 500)

    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_internal_error)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: RouterState = app.state.router
    state.subscriber.start()
    health = asyncio.create_task(state.health.run())
    try:
        yield
    finally:
        health.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await health
        state.subscriber.stop()
        await state.proxy.client.aclose()


# -- running -----------------------------------------------------------------------------------------


def run_router(
    config: RouterConfig, sock: socket.socket, host: str, tokenizer: Tokenizer | None = None
) -> None:
    """Register the replicas, then serve on `sock` (bound already) until SIGTERM/Ctrl-C."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per proxied request
    app = asyncio.run(build_router(config, tokenizer))
    uvicorn_config = uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=10)
    port = sock.getsockname()[1]
    logger.info("routing to %d replicas on http://%s:%d", len(config.replicas), host, port)
    UvicornServer(uvicorn_config, on_exit=lambda: None).run(sockets=[sock])  # exits 0 on SIGTERM
