"""`llmserve serve`: the OpenAI-compatible HTTP server (llmserve/entrypoints/openai/)."""

from __future__ import annotations

import argparse

from llmserve.config import EngineArgs
from llmserve.config.flags import add_flags
from llmserve.config.server import ServerConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve the model (default: the embedded SmolLM2-135M-Instruct) over an "
        "OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
        "/detokenize, /health and Prometheus /metrics.",
    )
    add_flags(serve, ServerConfig, "server")
    EngineArgs.add_cli_args(serve)
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    return run(ServerConfig.from_cli_args(args), EngineArgs.from_cli_args(args))


def run(config: ServerConfig, engine_args: EngineArgs) -> int:
    """One server, data-parallel replicas behind a router, or a headless node's ranks."""
    if config.data_parallel_size > 1 and engine_args.nnodes > 1:
        raise ValueError(
            "--nnodes spreads one engine's ranks over machines; for replicas on several machines run "
            "`llmserve serve` on each behind `llmserve router --replica URL ...`"
        )
    if config.headless:
        from llmserve.worker.headless import serve_headless

        return serve_headless(engine_args)
    if engine_args.node_rank:
        raise ValueError(f"--node-rank {engine_args.node_rank} runs no engine (node 0 does): add --headless")
    if config.data_parallel_size > 1:
        from llmserve.router.data_parallel import serve_data_parallel

        return serve_data_parallel(config, engine_args)
    from llmserve.entrypoints.openai.serve import run_server  # torch, FastAPI and uvicorn load only here

    return run_server(config, engine_args)
