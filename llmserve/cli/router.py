"""`llmserve router`: one OpenAI endpoint over several `llmserve serve` replicas (llmserve/router/)."""

from __future__ import annotations

import argparse
import os

from llmserve.config.flags import add_flags, from_namespace
from llmserve.config.router import RouterConfig, RoutingOptions
from llmserve.config.server import API_KEY_ENV


def register(subparsers: argparse._SubParsersAction) -> None:
    router = subparsers.add_parser(
        "router",
        help="route OpenAI requests over llmserve replicas by their cached prefixes",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics in "
        "front of llmserve replicas (each started with --kv-events-config): a request goes to the "
        "replica caching the longest prefix of its prompt, else to the least loaded one.",
    )
    router.add_argument(
        "--replica", action="append", required=True, metavar="URL", help="a replica's base URL (repeat)"
    )
    router.add_argument(
        "--model", default=None, help="the replicas' model, for its tokenizer; default: the embedded one"
    )
    router.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the router)")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the API routes and send the replicas the same key "
        "(also env LLMSERVE_API_KEY)",
    )
    router.add_argument(
        "--register-timeout",
        type=float,
        default=RouterConfig.register_timeout_seconds,
        help="seconds to wait at start-up for every replica to answer",
    )
    router.add_argument(
        "--prefill-replica",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill instance's base URL (repeat; started with --kv-transfer-config as kv_producer): "
        "a new request's prompt runs there first and its KV blocks move to the --replica (a kv_consumer) "
        "that then serves it",
    )
    router.add_argument(
        "--prefill-timeout",
        type=float,
        default=RouterConfig.prefill_timeout_seconds,
        help="seconds a prefill may take before the decode instance computes the prompt itself",
    )
    add_flags(router, RoutingOptions, "routing")
    router.set_defaults(handler=_route)


def _route(args: argparse.Namespace) -> int:
    from llmserve.entrypoints.openai.serve import bound_socket
    from llmserve.router.app import run_router

    for flag, url in [("--replica", url) for url in args.replica] + [
        ("--prefill-replica", url) for url in args.prefill_replica
    ]:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{flag} {url!r} must be an http:// or https:// URL")
    replicas = tuple(url.rstrip("/") for url in args.replica)
    prefill = tuple(url.rstrip("/") for url in args.prefill_replica)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    routing = from_namespace(RoutingOptions, args)
    config = RouterConfig.create(
        replicas, routing, args.model, args.register_timeout, api_key, prefill, args.prefill_timeout
    )
    with bound_socket(args.host, args.port) as sock:
        run_router(config, sock, args.host)
    return 0
