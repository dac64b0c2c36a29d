"""`llmserve serve` from launch to shutdown, in the order that makes start-up short.

The port is bound first (a busy port fails at once), then the engine process is forked with torch
already imported; FastAPI, uvicorn and the app's modules load in this process while the engine
process loads the model, so their imports are off the start-up's critical path (docs/benchmarks.md,
"Start-up"). Meanwhile a start-up responder answers on the port (503, /health `starting`, then
`warming` while the engine warms up, engine/warmup.py); the app runs once the engine is ready.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import socket
from collections.abc import Iterator

from llmserve.config import EngineArgs
from llmserve.config.server import ServerConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.health import EngineHealth, WatchdogConfig
from llmserve.engine.supervision import RestartPolicy
from llmserve.entrypoints.openai.chat_options import ChatOptions
from llmserve.entrypoints.openai.startup_responder import StartupResponder

logger = logging.getLogger("llmserve.server")

ENGINE_LOST_EXIT_CODE = 1  # the engine died and was not restarted (--no-engine-restart, or retries spent)


def run_server(config: ServerConfig, engine_args: EngineArgs) -> int:
    """Load the model, serve until SIGTERM/Ctrl-C, exit 0."""
    chat_options = ChatOptions.load(config.chat)  # a bad --chat-template fails before the model loads
    with bound_socket(config.host, config.port) as sock:
        responder = StartupResponder(sock)
        try:
            engine = AsyncLLM(
                engine_args,
                fork=_can_fork(),
                fork_closes=(sock.fileno(),),
                # after the fork: no thread is copied
                while_loading=lambda health: _while_loading(responder, health),
                bind_cpus=config.cpu_binding,
                warmup=config.warmup,
                restart=RestartPolicy(config.max_engine_restarts) if config.engine_restart else None,
                watchdog=WatchdogConfig(
                    min_seconds=config.watchdog_min_seconds, factor=config.watchdog_factor
                ),
            )
        finally:
            responder.stop()
        try:
            return _serve(engine, sock, config, chat_options)
        finally:
            engine.shutdown()


def _while_loading(responder: StartupResponder, health: EngineHealth) -> None:
    responder.start(health)  # starting, then warming: the engine's state while it loads and warms up
    # imported now, beside the model's loading: the app, and the first structured request's xgrammar
    import xgrammar  # noqa: F401

    import llmserve.entrypoints.openai.api_server  # noqa: F401


def _serve(engine: AsyncLLM, sock: socket.socket, config: ServerConfig, chat_options: ChatOptions) -> int:
    import uvicorn

    from llmserve.entrypoints.openai import api_server

    name = config.served_model_name or api_server.default_served_model_name(engine.config.model.path)
    app = _build_app(engine, name, config, chat_options)
    listener = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=api_server.GRACEFUL_SHUTDOWN_SECONDS,
    )
    server = api_server.UvicornServer(
        listener,
        on_exit=lambda: engine.shutdown(timeout=0),
        drain_seconds=config.shutdown_drain_seconds,
    )
    lost: list[str] = []

    def on_engine_lost(reason: str) -> None:  # the reader thread: uvicorn polls should_exit
        logger.error("the engine is gone and will not be restarted (%s); the server exits", reason)
        lost.append(reason)
        server.should_exit = True

    engine.on_engine_lost = on_engine_lost
    host, port = sock.getsockname()[:2]
    key_note = " (API key required)" if config.api_key else ""
    logger.info("serving %r on http://%s:%d%s", name, host, port, key_note)
    server.run(sockets=[sock])
    return ENGINE_LOST_EXIT_CODE if lost else 0


def _build_app(engine: AsyncLLM, name: str, config: ServerConfig, chat_options: ChatOptions):
    """The FastAPI app over `engine` with the config's admission bounds and metric names."""
    from llmserve.entrypoints.openai import api_server
    from llmserve.entrypoints.openai.admission import AdmissionConfig
    from llmserve.entrypoints.openai.structured_outputs import prepare_grammars
    from llmserve.metrics.prometheus import PrometheusMetrics

    app = api_server.build_app(
        engine,
        name,
        config.api_key,
        config.max_concurrent_requests,
        metrics=PrometheusMetrics(model_name=name, metric_names=config.metric_names),
        admission=AdmissionConfig(config.max_waiting_tokens, config.max_queue_delay),
        chat_options=chat_options,
    )
    prepare_grammars(app.state.llmserve.ctx)
    return app


def _can_fork() -> bool:
    """Fork the engine process where the platform has fork: nothing in this process has run a torch op
    yet (see AsyncLLM), and the child starts with the modules already imported."""
    return "fork" in multiprocessing.get_all_start_methods()


@contextlib.contextmanager
def bound_socket(host: str, port: int) -> Iterator[socket.socket]:
    """Bind now so a busy port fails before the model loads; uvicorn starts listening later."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            raise OSError(f"cannot bind {host}:{port}: {error.strerror}") from error
        yield sock
    finally:
        sock.close()
