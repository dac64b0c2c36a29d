"""KVEventsConfig: whether and where the engine publishes its KV-cache events (vLLM's --kv-events-config).

Same keys and defaults as vLLM's `KVEventsConfig`, given as one JSON object:
`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558"}'`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmserve.config.flags import json_object

PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False  # record block stored/removed events and publish them
    publisher: str = "zmq"  # "zmq" (PUB socket plus an optional replay socket) or "null" (discard)
    endpoint: str = "tcp://*:5557"  # where the PUB socket binds (a ZMQ endpoint)
    replay_endpoint: str | None = None  # where the replay (ROUTER) socket binds; None: no replay
    buffer_steps: int = 10_000  # recent batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark (messages queued per subscriber)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; past it a batch is dropped
    topic: str = ""  # the first frame of every message (subscribers filter on its prefix)

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON; ValueError (one line) for bad JSON, an unknown key or a bad value."""
        values = json_object(text, "--kv-events-config")
        fields = {spec.name: spec for spec in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"--kv-events-config has unknown keys {unknown}; known: {sorted(fields)}")
        config = cls(**values)
        config._check()
        return config

    def _check(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"--kv-events-config: publisher must be one of {PUBLISHERS}, got {self.publisher!r}"
            )
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"--kv-events-config: {name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("--kv-events-config: replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--kv-events-config: {name} must be a positive integer, got {value!r}")
