"""ServerConfig: `llmserve serve`'s own options (the engine's are EngineArgs), frozen, one flag per field
(config/flags.py): the HTTP server, its admission bounds, the engine's supervision, and the chat and
routing settings that travel with it."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Literal

from llmserve.config.flags import arg, changed_flags, check_choice, from_namespace, section
from llmserve.config.router import RoutingOptions

API_KEY_ENV = "LLMSERVE_API_KEY"  # the API key where --api-key is not given

MetricNames = Literal["both", "llmserve", "vllm"]
ToolCallParserName = Literal["hermes", "llama3_json"]  # entrypoints/openai/tool_parsers.py: TOOL_PARSERS
ReasoningParserName = Literal["deepseek_r1", "qwen3"]  # entrypoints/openai/reasoning_parsers.py

# what a data-parallel parent keeps to itself: its address, replication, routing; the API key travels
# in the replicas' environment (`ps` shows a command line) and the template as an absolute path
_PARENT_ONLY = frozenset(
    {"host", "port", "api_key", "data_parallel_size", "headless", "routing", "chat_template"}
)


@dataclass(frozen=True)
class ChatConfig:
    """How chat prompts are built and chat outputs parsed (vLLM's flag names)."""

    chat_template: str | None = arg(
        None,
        "a Jinja chat template file that replaces the model's own (docs/server.md, 'Tool calling')",
        metavar="FILE",
    )
    tool_call_parser: ToolCallParserName = arg(
        "hermes",
        "tool-call format: hermes (<tool_call>{json}</tool_call>: Hermes, Qwen; the default) "
        'or llama3_json ({"name": ..., "parameters": ...}: Llama 3)',
    )
    reasoning_parser: ReasoningParserName | None = arg(
        None, "split <think>...</think> off into message.reasoning (qwen3: Qwen3; deepseek_r1: DeepSeek-R1)"
    )

    def __post_init__(self) -> None:
        check_choice("tool_call_parser", self.tool_call_parser, ToolCallParserName)
        if self.reasoning_parser is not None:
            check_choice("reasoning_parser", self.reasoning_parser, ReasoningParserName)


@dataclass(frozen=True)
class ServerConfig:
    """`llmserve serve`'s options besides the engine's; `from_cli_args` resolves the API key from the
    environment, so the config holds what the server uses."""

    host: str = arg("127.0.0.1", "address to bind (0.0.0.0 exposes the server)")
    port: int = arg(8000, "port to bind")
    api_key: str | None = arg(
        None, f"require 'Authorization: Bearer KEY' on the API routes (also env {API_KEY_ENV})", repr=False
    )
    served_model_name: str | None = arg(None, "the model name clients send; default: the model file's stem")
    metric_names: MetricNames = arg(
        "both", "prefixes /metrics exports every series under: llmserve: and vLLM's vllm: (both), or one"
    )
    max_concurrent_requests: int = arg(
        256,
        "requests in flight (running + waiting in the engine) before the server answers 429 "
        "(--max-waiting is the old name)",
        aliases=("--max-waiting",),
    )
    max_waiting_tokens: int = arg(
        262144,
        "prompt tokens queued (sent to the engine, no output yet) before the server answers 429 with a "
        "computed Retry-After",
    )
    max_queue_delay: float | None = arg(
        None,
        "seconds of predicted queue wait before the server answers 429 with a computed Retry-After "
        "(a request's own `timeout` field bounds it too)",
    )
    engine_restart: bool = arg(
        True,
        "restart the engine process when it (or a worker) dies; --no-engine-restart exits non-zero "
        "instead, for orchestrators that restart the pod (docs/reliability.md)",
    )
    max_engine_restarts: int = arg(
        5,
        "engine restarts within 10 minutes (back-off 1 s, doubling, at most 30 s) before the server exits "
        "non-zero",
    )
    watchdog_min_seconds: float = arg(
        30.0,
        "the shortest time without a finished engine step, while requests are in flight, that turns "
        "/health to 503 'stalled' (the limit grows with the predicted step time)",
    )
    watchdog_factor: float = arg(
        20.0,
        "the stall limit is this many times the predicted time of the largest step the scheduler can plan "
        "(never under --watchdog-min-seconds)",
    )
    shutdown_drain_seconds: float = arg(
        0.0,
        "on SIGTERM, go on answering this long (/health 503 'stopping', requests 503) before the listener "
        "closes, so a load balancer sees the server leave",
    )
    cpu_binding: bool = arg(
        True,
        "CPU engine: pin its threads one per CPU and keep the server's threads off the CPU of its main "
        "thread",
    )
    warmup: bool = arg(
        True,
        "before /health says ready, run a few short requests through the engine (a prefill, decodes, a "
        "prefix-cache hit, sampling, speculation) and finish faulting in the KV pool, so the first requests "
        "pay no first-use costs; /health answers 503 'warming' meanwhile",
    )
    data_parallel_size: int = arg(
        1,
        "engine replicas, each on its own share of the CPUs with its own KV pool, behind one prefix-aware "
        "router on --port (docs/parallelism.md)",
    )
    headless: bool = arg(
        False,
        "with --nnodes and --node-rank >= 1: run only this machine's tensor-parallel ranks, which join "
        "node 0's engine at --master-addr (no server, no engine; docs/parallelism.md)",
    )
    chat: ChatConfig = section(ChatConfig, "chat")
    routing: RoutingOptions = section(RoutingOptions, "routing")

    def __post_init__(self) -> None:
        check_choice("metric_names", self.metric_names, MetricNames)
        positive = {
            "--max-concurrent-requests": self.max_concurrent_requests,
            "--max-waiting-tokens": self.max_waiting_tokens,
            "--data-parallel-size": self.data_parallel_size,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.max_queue_delay is not None and self.max_queue_delay < 0:
            raise ValueError(f"--max-queue-delay must be >= 0, got {self.max_queue_delay}")
        if self.max_engine_restarts < 0 or self.shutdown_drain_seconds < 0:
            raise ValueError("--max-engine-restarts and --shutdown-drain-seconds must be >= 0")
        if not 0 < self.watchdog_min_seconds < math.inf:
            raise ValueError(f"--watchdog-min-seconds must be > 0, got {self.watchdog_min_seconds}")
        if not 0 < self.watchdog_factor < math.inf:
            raise ValueError(f"--watchdog-factor must be > 0, got {self.watchdog_factor}")

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> ServerConfig:
        config = from_namespace(cls, namespace)
        return dataclasses.replace(config, api_key=config.api_key or os.environ.get(API_KEY_ENV) or None)

    def replica_flags(self) -> list[str]:
        """The flags a data-parallel replica's server is started with: the options given here, less the
        ones the parent keeps, and the chat template's absolute path (replicas may run elsewhere)."""
        flags = changed_flags(self, _PARENT_ONLY)
        if self.chat.chat_template is not None:
            flags += ["--chat-template", os.path.abspath(self.chat.chat_template)]
        return flags
