"""What each rank (tensor-parallel or pipeline) reports of itself: its forward time, its KV pool, its process.

Under tensor parallelism every rank holds its own shard, its own share of the KV pool (its KV heads)
and its own copy of the requests' block tables, so these numbers are each rank's own, measured where
they happen. A worker rank (worker/tp_worker.py) sends a `RankStats` to rank 0 over the pipe it
reported its start-up on, at most once per `REPORT_INTERVAL_SECONDS` and only after a step: nothing
crosses when the engine idles, and nothing is added to a step's collectives. Rank 0 keeps the latest
of each (worker/executor.py) and the engine passes them to the server with its gauges, where
metrics/prometheus.py exposes them with a `rank` label. A Ray actor keeps its latest report for
rank 0 to ask for (worker/ray_launcher.py); a pipeline stage reports like a tensor-parallel rank. An
engine with one rank has no ranks to report and runs none of this.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Protocol

import msgspec

from llmserve.distributed.expert_parallel import total_expert_load

REPORT_INTERVAL_SECONDS = 1.0


class RankStats(msgspec.Struct, frozen=True, gc=False):
    rank: int
    pid: int
    num_steps: int = 0  # steps this rank has run its shard for
    forward_seconds: float = 0.0  # wall time in its shard's forward and sampling inputs, summed
    kv_num_blocks: int = 0  # blocks in its KV pool (each holds only this rank's KV heads)
    kv_blocks_used: int = 0  # blocks its live requests' block tables hold, by its own copy of them
    kv_cache_bytes: int = 0  # bytes of its KV pool
    exit_code: int | None = None  # set once the process has exited; None while it runs
    # mixture-of-experts models: (token, expert) pairs the rank computed per expert it holds, over its
    # expert layers, since start-up (every expert under tensor parallelism, its own under expert
    # parallelism), the first of them, and the bytes its all-to-alls sent to the other ranks
    expert_tokens: tuple[int, ...] = ()
    first_expert: int = 0
    all_to_all_bytes: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_num_blocks if self.kv_num_blocks else 0.0


class ReportSink(Protocol):
    """Where a worker rank sends its reports: its start-up pipe, or a Ray actor's latest report."""

    def send(self, stats: RankStats) -> None: ...


class RankMeter:
    """One rank's running totals; `snapshot` reads its KV pool off the runner's request states."""

    def __init__(self, rank: int, runner) -> None:
        self.rank = rank
        self.runner = runner  # worker/model_runner.py:ModelRunner
        self.num_steps = 0
        self.forward_seconds = 0.0
        self._last_report = -float("inf")

    def add_step(self, seconds: float) -> None:
        self.num_steps += 1
        self.forward_seconds += seconds

    def report_due(self, now: float | None = None) -> bool:
        """True at most once per interval (and at the first step): time to send a snapshot."""
        now = time.monotonic() if now is None else now
        if now - self._last_report < REPORT_INTERVAL_SECONDS:
            return False
        self._last_report = now
        return True

    def snapshot(self) -> RankStats:
        kv_cache = self.runner.kv_cache
        first_expert, expert_tokens, all_to_all_bytes = total_expert_load(self.runner.model)
        return RankStats(
            rank=self.rank,
            pid=os.getpid(),
            num_steps=self.num_steps,
            forward_seconds=self.forward_seconds,
            kv_num_blocks=self.runner.config.cache.num_blocks,
            kv_blocks_used=blocks_in_use(state.block_ids for state in self.runner.requests.values()),
            kv_cache_bytes=kv_cache.numel() * kv_cache.element_size(),
            expert_tokens=expert_tokens,
            first_expert=first_expert,
            all_to_all_bytes=all_to_all_bytes,
        )


def blocks_in_use(block_tables: Iterable[list[int]]) -> int:
    """Distinct blocks over the block tables (parallel samples share their prompt's blocks)."""
    used: set[int] = set()
    for table in block_tables:
        used.update(table)
    used.discard(-1)  # NULL_BLOCK: an entry a sliding window freed
    return len(used)
