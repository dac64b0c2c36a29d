"""`llmserve serve`: the OpenAI-compatible HTTP server (llmserve/entrypoints/openai/)."""

from __future__ import annotations

import argparse

from llmserve.cli import router
from llmserve.config import EngineArgs
from llmserve.entrypoints.openai.chat_options import add_chat_arguments


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve the model (default: the embedded SmolLM2-135M-Instruct) over an "
        "OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
        "/detokenize, /health and Prometheus /metrics.",
    )
    group = serve.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the API routes (also env LLMSERVE_API_KEY)",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send; default: the model file's stem",
    )
    group.add_argument(
        "--metric-names",
        choices=("both", "llmserve", "vllm"),
        default="both",
        help="prefixes /metrics exports every series under: llmserve: and vLLM's vllm: (both), or one",
    )
    group.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="requests in flight (running + waiting) before the server answers 429",
    )
    group.add_argument(
        "--max-waiting-tokens",
        type=int,
        default=262144,
        help="prompt tokens queued (sent to the engine, no output yet) before the server answers 429 "
        "with a computed Retry-After",
    )
    group.add_argument(
        "--max-queue-delay",
        type=float,
        default=None,
        help="seconds of predicted queue wait before the server answers 429 with a computed Retry-After "
        "(a request's own `timeout` field bounds it too)",
    )
    group.add_argument(
        "--engine-restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="restart the engine process when it (or a worker) dies; --no-engine-restart exits non-zero "
        "instead, for orchestrators that restart the pod (docs/reliability.md)",
    )
    group.add_argument(
        "--max-engine-restarts",
        type=int,
        default=5,
        help="engine restarts within 10 minutes (back-off 1 s, doubling, at most 30 s) before the server "
        "exits non-zero",
    )
    group.add_argument(
        "--watchdog-min-seconds",
        type=float,
        default=30.0,
        help="the shortest time without a finished engine step, while requests are in flight, that "
        "turns /health to 503 'stalled' (the limit grows with the predicted step time)",
    )
    group.add_argument(
        "--shutdown-drain-seconds",
        type=float,
        default=0.0,
        help="on SIGTERM, go on answering this long (/health 503 'stopping', requests 503) before the "
        "listener closes, so a load balancer sees the server leave",
    )
    group.add_argument(
        "--cpu-binding",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU engine: pin its threads one per CPU and keep the server's threads off the CPU of its "
        "main thread (default on)",
    )
    group.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before /health says ready, run a few short requests through the engine (a prefill, decodes, "
        "a prefix-cache hit, sampling, speculation) and finish faulting in the KV pool, so the first "
        "requests pay no first-use costs; /health answers 503 'warming' meanwhile (default on)",
    )
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas, each on its own share of the CPUs with its own KV pool, behind one "
        "prefix-aware router on --port (docs/parallelism.md)",
    )
    group.add_argument(
        "--headless",
        action="store_true",
        help="with --nnodes and --node-rank >= 1: run only this machine's tensor-parallel ranks, which "
        "join node 0's engine at --master-addr (no server, no engine; docs/parallelism.md)",
    )
    add_chat_arguments(serve)
    router.add_routing_arguments(serve)
    EngineArgs.add_cli_args(serve)
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1 and args.nnodes > 1:
        raise ValueError(
            "--nnodes spreads one engine's ranks over machines; for replicas on several machines run "
            "`llmserve serve` on each behind `llmserve router --replica URL ...`"
        )
    if args.headless:
        from llmserve.worker.headless import serve_headless

        return serve_headless(EngineArgs.from_cli_args(args))
    if args.node_rank:
        raise ValueError(f"--node-rank {args.node_rank} runs no engine (node 0 does): add --headless")
    if args.data_parallel_size > 1:
        from llmserve.router.data_parallel import serve_data_parallel

        return serve_data_parallel(args)
    from llmserve.entrypoints.openai.serve import run_server  # torch, FastAPI and uvicorn load only here

    return run_server(args)
