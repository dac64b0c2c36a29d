"""RouterConfig: the prefix-aware router in front of data-parallel replicas (llmserve/router/)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[str, ...]  # base URLs of the replicas' OpenAI servers (http://host:port)
    model: str | None = None  # the replicas' model (GGUF or HF dir), for its tokenizer; None: the default
    max_imbalance: int = 4  # prefix routing may load a replica with this many more requests than the least
    health_interval_seconds: float = 1.0  # how often each replica's /health and /metrics are read
    register_timeout_seconds: float = 30.0  # how long start-up waits for every replica to answer
    pending_prefix_seconds: float = 10.0  # a routed prompt counts as cached there until its events arrive
    # clients must send 'Authorization: Bearer KEY' (as `serve --api-key`); the replicas get it too
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("the router needs at least one --replica URL")
        if len(set(self.replicas)) != len(self.replicas):
            raise ValueError("a --replica URL is given twice")
        if self.max_imbalance < 0:
            raise ValueError(f"--max-imbalance must be >= 0, got {self.max_imbalance}")
        if self.health_interval_seconds <= 0 or self.register_timeout_seconds <= 0:
            raise ValueError("--health-interval and --register-timeout must be > 0")

    @classmethod
    def from_cli_args(
        cls,
        args: argparse.Namespace,
        replicas: tuple[str, ...],
        register_timeout: float,
        api_key: str | None = None,
    ) -> RouterConfig:
        """From the routing flags (cli/router.py: add_routing_arguments) of `router` or `serve`."""
        return cls(
            replicas=replicas,
            model=args.model,
            max_imbalance=args.max_imbalance,
            health_interval_seconds=args.health_interval,
            register_timeout_seconds=register_timeout,
            api_key=api_key,
        )
