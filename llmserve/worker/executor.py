"""Rank 0's side of tensor parallelism: the worker processes, each step's plan to them, their health.

The engine process is rank 0: it schedules, runs its own shard and samples. The executor starts
ranks 1..N-1 (spawned, each `tp_worker.run_worker`), which load their shards while rank 0 loads
its own; `wait_until_ready` then joins the process group. Each step it broadcasts the plan and runs
rank 0's runner; the collectives inside the forward keep the ranks in step.

Failure: a worker that exits (found before a step, by the collective it breaks, or while the
engine idles by `check_workers` on its sentinel) or a collective that times out fails the step with
a `TensorParallelError` naming the rank, and every later step with the same error: the group cannot
be resynchronized, so the other workers are stopped. `failure` says so to the engine's health.

Status: each worker sends its `RankStats` (metrics/ranks.py) up the pipe it reported its start-up on;
`rank_stats` drains those pipes without blocking and adds rank 0's own.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from multiprocessing.connection import wait

import msgspec
import torch

from llmserve.config import EngineConfig
from llmserve.core.step_plan import StepPlan
from llmserve.distributed.group import TensorParallelGroup
from llmserve.metrics.ranks import RankMeter, RankStats
from llmserve.worker.model_runner import ModelRunner, ModelRunnerOutput
from llmserve.worker.tp_worker import run_worker

logger = logging.getLogger("llmserve")

_STOP_GRACE_SECONDS = 10.0
_DEATH_GRACE_SECONDS = 5.0  # how long a failed step waits to learn whether a worker died


class TensorParallelError(RuntimeError):
    pass


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig) -> None:
        if torch.distributed.is_initialized():  # its default group is one per process
            raise TensorParallelError(
                "this process already runs a tensor-parallel engine; shut that down first"
            )
        parallel = config.parallel
        self.config = config
        self.group = TensorParallelGroup(0, parallel.world_size)
        self._rendezvous = tempfile.mkdtemp(prefix="llmserve-tp-")  # the ranks meet at a file store
        self._init_method = f"file://{self._rendezvous}/store"
        self._failure: str | None = None
        self._closed = False
        self._encoder = msgspec.msgpack.Encoder()
        context = multiprocessing.get_context("spawn")  # a fork would copy OpenMP's threads' state
        self.workers: list[multiprocessing.Process] = []
        self._ready = []  # each worker's pipe: its start-up result, then its RankStats
        self._rank_stats: dict[int, RankStats] = {}
        self._meter: RankMeter | None = None  # rank 0's, made with its runner at the first step
        for rank in range(1, parallel.world_size):
            receive, send = context.Pipe(duplex=False)
            worker = context.Process(
                target=run_worker,
                args=(config, rank, self._init_method, send, logger.getEffectiveLevel()),
                name=f"llmserve-tp-rank{rank}",
                daemon=True,
            )
            worker.start()
            send.close()
            self.workers.append(worker)
            self._ready.append(receive)
        self._threads_before = torch.get_num_threads()  # rank 0 is this process: restored at shutdown
        torch.set_num_threads(parallel.threads_per_rank())

    def wait_until_ready(self) -> None:
        """Wait until every worker has loaded its shard, then join the process group."""
        for rank, (worker, ready) in enumerate(zip(self.workers, self._ready, strict=True), start=1):
            wait([ready, worker.sentinel])
            try:
                message = ready.recv()
            except EOFError:  # it exited before it could say why (its log has the traceback)
                worker.join()
                message = f"it exited with code {worker.exitcode}"
            if message is not None:
                self.shutdown()
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to load its shard: {message}")
        parallel = self.config.parallel
        self.group.connect(self._init_method, self.config.model.device, parallel.collective_timeout_seconds)
        logger.info(
            "tensor parallelism: %d ranks, %d threads each", parallel.world_size, torch.get_num_threads()
        )

    def execute(self, runner: ModelRunner, plan: StepPlan) -> ModelRunnerOutput:
        """Send the plan to every worker and run rank 0's shard; the workers run theirs in step."""
        if self._failure is None:
            self._failure = self._exited_workers()
        if self._failure is not None:
            raise TensorParallelError(self._failure)
        try:
            self.group.broadcast_bytes(self._encoder.encode(plan))
            start = time.perf_counter()
            output = runner.execute(plan)
        except Exception as error:
            # Whatever broke, the ranks are out of step now: a collective or a rank's work is missing.
            # a peer's death reaches rank 0 as a reset connection, maybe before its exit is reaped
            wait(self.sentinels(), timeout=_DEATH_GRACE_SECONDS)
            self._fail(self._exited_workers() or f"tensor-parallel step failed on rank 0: {error}")
            raise TensorParallelError(self._failure) from error
        if self._meter is None:
            self._meter = RankMeter(0, runner)
        self._meter.add_step(time.perf_counter() - start)
        if self._meter.report_due():  # as often as the workers report theirs
            self._rank_stats[0] = self._meter.snapshot()
        return output

    @property
    def failure(self) -> str | None:
        """Why the group can no longer step (a rank exited, a collective failed); None while it can."""
        return self._failure

    def sentinels(self) -> list[int]:
        """The workers' process sentinels: each is ready once its worker has exited."""
        return [worker.sentinel for worker in self.workers]

    def check_workers(self) -> str | None:
        """`failure`, after looking for a worker that has exited (then the others are stopped)."""
        if self._failure is None and not self._closed:
            exited = self._exited_workers()
            if exited is not None:
                self._fail(exited)
        return self._failure

    def rank_stats(self) -> tuple[RankStats, ...]:
        """Every rank's latest report, with the exit code of those that exited."""
        for rank, pipe in enumerate(self._ready, start=1):
            with contextlib.suppress(EOFError, OSError):
                while pipe.poll(0):
                    self._rank_stats[rank] = pipe.recv()
        stats = [self._rank_stats.get(0) or RankStats(0, os.getpid())]
        for rank, worker in enumerate(self.workers, start=1):
            report = self._rank_stats.get(rank) or RankStats(rank, worker.pid or 0)
            if self._failure is not None and worker.exitcode is not None:
                report = msgspec.structs.replace(report, exit_code=worker.exitcode)
            stats.append(report)
        return tuple(stats)

    def _fail(self, failure: str) -> None:
        self._failure = failure
        logger.error("%s; stopping the other tensor-parallel ranks", failure)
        self._stop_workers()

    def shutdown(self) -> None:
        """Stop the workers (the empty plan, then a kill for any that do not exit) and leave the group."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None and self.group.is_connected:
            with contextlib.suppress(Exception):
                self.group.broadcast_bytes(b"")
        self._stop_workers()
        self.group.close()
        shutil.rmtree(self._rendezvous, ignore_errors=True)
        torch.set_num_threads(self._threads_before)

    def _stop_workers(self) -> None:
        for worker in self.workers:
            worker.join(_STOP_GRACE_SECONDS if self._failure is None else 0)
            if worker.is_alive():
                worker.kill()
                worker.join()

    def _exited_workers(self) -> str | None:
        ready = wait(self.sentinels(), timeout=0)
        exited = [
            (rank, worker) for rank, worker in enumerate(self.workers, start=1) if worker.sentinel in ready
        ]
        if not exited:
            return None
        rank, worker = exited[0]
        # its sentinel closes as it exits, a moment before it can be reaped: wait for its exit code
        worker.join(_DEATH_GRACE_SECONDS)
        return f"tensor-parallel rank {rank} (pid {worker.pid}) exited with code {worker.exitcode}"
