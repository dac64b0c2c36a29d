"""RouterConfig: the prefix-aware router in front of data-parallel replicas (llmserve/router/)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.config.flags import arg

_MAX_IMBALANCE = 4
_HEALTH_INTERVAL_SECONDS = 1.0
_PREFILL_TIMEOUT_SECONDS = 60.0


@dataclass(frozen=True)
class RoutingOptions:
    """The routing flags `llmserve router` and `llmserve serve --data-parallel-size` share."""

    max_imbalance: int = arg(
        _MAX_IMBALANCE,
        "route to the replica caching the prompt's prefix only while it has at most this many more "
        "requests than the least loaded one",
    )
    health_interval: float = arg(_HEALTH_INTERVAL_SECONDS, "seconds between health checks of each replica")


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[str, ...]  # base URLs of the replicas' OpenAI servers (http://host:port)
    model: str | None = None  # the replicas' model (GGUF or HF dir), for its tokenizer; None: the default
    # prefix routing may load a replica with this many more requests than the least
    max_imbalance: int = _MAX_IMBALANCE
    # how often each replica's /health and /metrics are read
    health_interval_seconds: float = _HEALTH_INTERVAL_SECONDS
    register_timeout_seconds: float = 30.0  # how long start-up waits for every replica to answer
    pending_prefix_seconds: float = 10.0  # a routed prompt counts as cached there until its events arrive
    # clients must send 'Authorization: Bearer KEY' (as `serve --api-key`); the replicas get it too
    api_key: str | None = field(default=None, repr=False)
    # prefill/decode disaggregation (router/disaggregation.py): prefill instances' base URLs; with any,
    # `replicas` are the decode instances. (): every replica serves whole requests
    prefill_replicas: tuple[str, ...] = ()
    # how long a prompt's prefill may take before the decode instance computes it alone
    prefill_timeout_seconds: float = _PREFILL_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("the router needs at least one --replica URL")
        if len(set(self.replicas)) != len(self.replicas):
            raise ValueError("a --replica URL is given twice")
        if self.max_imbalance < 0:
            raise ValueError(f"--max-imbalance must be >= 0, got {self.max_imbalance}")
        if self.health_interval_seconds <= 0 or self.register_timeout_seconds <= 0:
            raise ValueError("--health-interval and --register-timeout must be > 0")
        if len(set(self.prefill_replicas)) != len(self.prefill_replicas):
            raise ValueError("a --prefill-replica URL is given twice")
        if set(self.prefill_replicas) & set(self.replicas):
            raise ValueError("a URL is both a --prefill-replica and a --replica (a decode instance)")
        if not self.prefill_timeout_seconds > 0:
            raise ValueError(f"--prefill-timeout must be > 0, got {self.prefill_timeout_seconds}")

    @classmethod
    def create(
        cls,
        replicas: tuple[str, ...],
        routing: RoutingOptions,
        model: str | None,
        register_timeout: float,
        api_key: str | None = None,
        prefill_replicas: tuple[str, ...] = (),
        prefill_timeout: float = _PREFILL_TIMEOUT_SECONDS,
    ) -> RouterConfig:
        """From the routing flags of `router` or `serve` and the replicas they route to."""
        return cls(
            prefill_replicas=prefill_replicas,
            prefill_timeout_seconds=prefill_timeout,
            replicas=replicas,
            model=model,
            max_imbalance=routing.max_imbalance,
            health_interval_seconds=routing.health_interval,
            register_timeout_seconds=register_timeout,
            api_key=api_key,
        )
