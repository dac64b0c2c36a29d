"""The replicas behind the router: registration checks, health and load.

A replica registers only if the router would compute its block hashes: the same served model,
block size, hash scheme and tokenizer as the router and every other replica (`/server_info`,
entrypoints/openai/server_info.py); anything else is a one-line `ValueError` naming the replica and
the mismatch. While serving, `HealthChecker` reads each replica's /health and Prometheus /metrics
(waiting and running requests, KV-cache usage, prefix-cache counters) every interval; a replica that
fails (its /health is 503 when any of its tensor-parallel ranks died) is routed around until it
answers again, and it is checked again before it takes requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx
import pydantic
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from llmserve.core.kv_events import BLOCK_HASH_SCHEME
from llmserve.entrypoints.openai.server_info import ServerInfo

logger = logging.getLogger("llmserve.router")

_METRICS = {  # Prometheus sample -> (Replica field, type)
    "llmserve:num_requests_waiting": ("num_waiting", int),
    "llmserve:num_requests_running": ("num_running", int),
    "llmserve:kv_cache_usage_perc": ("kv_cache_usage", float),
    "llmserve:prefix_cache_queries_total": ("prefix_cache_queries", float),
    "llmserve:prefix_cache_hits_total": ("prefix_cache_hits", float),
}
PROBE_TIMEOUT_SECONDS = 2.0


@dataclass
class Replica:
    url: str
    info: ServerInfo
    healthy: bool = True
    in_flight: int = 0  # requests this router has sent it that have not finished
    num_waiting: int = 0  # from its /metrics, as of the last health check
    num_running: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    last_error: str = field(default="", repr=False)
    metric_families: list[Metric] = field(default_factory=list, repr=False)  # its /metrics, last read

    @property
    def load(self) -> int:
        """Requests in the replica: the router's own count, or its metrics' if others send it more."""
        return max(self.in_flight, self.num_waiting + self.num_running)

    def mark_failed(self, error: str) -> None:
        if self.healthy:
            logger.warning("replica %s failed (%s); routing around it", self.url, error)
        self.healthy, self.last_error = False, error


def check_compatible(url: str, info: ServerInfo, expected: ServerInfo, needs_events: bool = True) -> None:
    """Raise ValueError (one line) unless the replica hashes blocks as `expected` does and has its
    prefill/decode role; `needs_events`: it must publish KV events (a prefill instance need not)."""
    if info.hash_scheme != BLOCK_HASH_SCHEME:
        raise ValueError(f"replica {url} hashes blocks with {info.hash_scheme!r}, not {BLOCK_HASH_SCHEME!r}")
    for name in ("model", "block_size", "tokenizer_fingerprint", "kv_role"):
        got, want = getattr(info, name), getattr(expected, name)
        if got != want:
            raise ValueError(f"replica {url} has {name} {got!r}, but the router expects {want!r}")
    if not info.prefix_caching:
        raise ValueError(f"replica {url} runs without prefix caching; start it without --no-prefix-caching")
    if info.kv_events is None and needs_events:
        raise ValueError(f"replica {url} publishes no KV events; start it with --kv-events-config")


async def fetch_info(client: httpx.AsyncClient, url: str) -> ServerInfo:
    response = await client.get(f"{url}/server_info", timeout=PROBE_TIMEOUT_SECONDS)
    if response.status_code != 200:
        raise ValueError(f"its /server_info answered HTTP {response.status_code}")
    try:
        return ServerInfo.model_validate_json(response.content)
    except pydantic.ValidationError:
        raise ValueError("its /server_info is not an llmserve replica's") from None


async def wait_for_info(client: httpx.AsyncClient, url: str, timeout: float) -> ServerInfo:
    """The replica's /server_info once it answers; ValueError if it does not in `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await fetch_info(client, url)
        except (httpx.TransportError, ValueError) as error:
            if time.monotonic() > deadline:
                raise ValueError(f"replica {url} is unreachable: {_describe(error)}") from None
            await asyncio.sleep(0.2)


class HealthChecker:
    """Polls every replica's /health and /metrics; `run` until cancelled."""

    def __init__(self, client: httpx.AsyncClient, replicas: list[Replica], interval: float) -> None:
        self.client = client
        self.replicas = replicas
        self.interval = interval

    async def run(self) -> None:
        while True:
            await asyncio.gather(*(self.check(replica) for replica in self.replicas))
            await asyncio.sleep(self.interval)

    async def check(self, replica: Replica) -> None:
        try:
            health = await self.client.get(f"{replica.url}/health", timeout=PROBE_TIMEOUT_SECONDS)
            if health.status_code != 200:
                raise ValueError(f"/health answered HTTP {health.status_code}{_error_message(health)}")
            if not replica.healthy:  # it may have restarted as something else
                info, events = await fetch_info(self.client, replica.url), replica.info.kv_events is not None
                check_compatible(replica.url, info, replica.info, needs_events=events)
            await self.read_metrics(replica)
        except (httpx.TransportError, ValueError) as error:
            replica.mark_failed(_describe(error))
            return
        if not replica.healthy:
            logger.info("replica %s is healthy again", replica.url)
        replica.healthy = True

    async def read_all_metrics(self) -> None:
        """Read every healthy replica's /metrics now (a scrape of the router's own); failures are
        left to the health check."""

        async def read(replica: Replica) -> None:
            try:
                await self.read_metrics(replica)
            except (httpx.TransportError, ValueError) as error:
                logger.debug("reading %s/metrics failed: %s", replica.url, _describe(error))

        await asyncio.gather(*(read(replica) for replica in self.replicas if replica.healthy))

    async def read_metrics(self, replica: Replica) -> None:
        response = await self.client.get(f"{replica.url}/metrics", timeout=PROBE_TIMEOUT_SECONDS)
        if response.status_code != 200:
            raise ValueError(f"/metrics answered HTTP {response.status_code}")
        replica.metric_families = list(text_string_to_metric_families(response.text))
        for family in replica.metric_families:
            for sample in family.samples:
                key = sample.name.replace("vllm:", "llmserve:", 1)  # a replica may export only vllm:
                if key in _METRICS:
                    name, kind = _METRICS[key]
                    setattr(replica, name, kind(sample.value))


def _error_message(response: httpx.Response) -> str:
    """': <message>' from an OpenAI error body, or nothing."""
    try:
        return f": {response.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return ""


def _describe(error: Exception) -> str:
    return str(error) or type(error).__name__
