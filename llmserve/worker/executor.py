"""Rank 0's side of tensor and pipeline parallelism: the other ranks, each step's plan to them, their
health.

The engine process is rank 0: it schedules, runs its own shard and samples. A launcher
(worker/launcher.py) starts the other ranks, which load their shards while rank 0 loads its own:
processes of this machine (`mp`), Ray actors on a Ray cluster (`ray`); with `mp --nnodes N` this
machine starts only its share and the other nodes' `llmserve serve --headless` start theirs.
`wait_until_ready` then meets them at rank 0's store (distributed/rendezvous.py: versions and
settings checked) and joins the process group. Each step it broadcasts the plan and runs rank 0's
runner; the collectives inside the forward keep the ranks in step. Under pipeline parallelism the
engine drives the stages through worker/pipeline_stage.py instead, inside `step_guard` as well.

Failure: a rank that exits (found before a step, by the collective it breaks, or while the engine
idles by `check_workers` on its sentinel) or a collective that times out fails the step with a
`TensorParallelError` naming the rank, and every later step with the same error: the group cannot
be resynchronized, so the other ranks are stopped (those of other nodes see the group torn down and
exit). `failure` says so to the engine's health.

Status: each process rank sends its `RankStats` (metrics/ranks.py) up the pipe it reported its
start-up on; `rank_stats` collects them through the launcher and adds rank 0's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import msgspec
import torch

from llmserve.config import EngineConfig
from llmserve.core.step_plan import StepPlan
from llmserve.distributed.group import TensorParallelGroup
from llmserve.distributed.pipeline import PipelineGroup, PipelineLayout
from llmserve.distributed.rendezvous import Rendezvous, RendezvousError, admit, exit_note, rank_info
from llmserve.metrics.ranks import RankMeter, RankStats
from llmserve.worker.launcher import RankLauncher
from llmserve.worker.model_runner import ModelRunner, ModelRunnerOutput
from llmserve.worker.process_launcher import ProcessRanks

logger = logging.getLogger("llmserve")

_STOP_GRACE_SECONDS = 10.0
_DEATH_GRACE_SECONDS = 5.0  # how long a failed step waits to learn whether a rank died


class TensorParallelError(RuntimeError):
    pass


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig) -> None:
        if torch.distributed.is_initialized():  # its default group is one per process
            raise TensorParallelError(
                "this process already runs a tensor-parallel engine; shut that down first"
            )
        parallel = config.parallel
        if parallel.node_rank != 0:
            raise ValueError(
                f"node {parallel.node_rank} runs no engine (node 0 does): start it with `serve --headless`"
            )
        self.config = config
        self.group = TensorParallelGroup(  # stage 0's ranks
            0, parallel.tensor_parallel_size, parallel.enable_expert_parallel, parallel.all2all_backend
        )
        layout = PipelineLayout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.pipeline = PipelineGroup(layout, 0, self.group) if layout.pipeline_parallel_size > 1 else None
        self._world = self.pipeline or self.group  # what this rank joins, stops and leaves
        self._failure: str | None = None
        self._closed = False
        self._encoder = msgspec.msgpack.Encoder()
        self._scratch = tempfile.mkdtemp(prefix="llmserve-tp-")  # a one-machine group's file store
        self._threads_before = torch.get_num_threads()  # rank 0 is this process: restored at shutdown
        self._meter: RankMeter | None = None  # rank 0's, made with its runner at the first step
        self._own_stats: RankStats | None = None
        self.launcher: RankLauncher | None = None
        try:
            self._store, self.rendezvous = self._rendezvous().host_store()
            self.launcher = self._launch()
            self._take_rank0_device()
        except (RendezvousError, ValueError) as error:
            self.shutdown()
            raise ValueError(str(error)) from None
        torch.set_num_threads(parallel.threads_per_rank())

    def _take_rank0_device(self) -> None:
        """Compute on the device the launcher assigns rank 0 (Ray: bundle 0's GPU); the engine reads
        `config` back."""
        model = self.config.model
        device = self.launcher.rank0_device(model.device)
        if device != model.device:
            torch.cuda.set_device(device)
            self.config = dataclasses.replace(self.config, model=dataclasses.replace(model, device=device))

    def _rendezvous(self) -> Rendezvous:
        parallel = self.config.parallel
        timeout = parallel.collective_timeout_seconds
        if parallel.distributed_executor_backend == "ray":
            from llmserve.worker.ray_launcher import connect_ray

            return Rendezvous.tcp(connect_ray(timeout), 0, timeout)  # a free port on this node
        if parallel.nnodes > 1:
            return Rendezvous.tcp(parallel.master_addr, parallel.master_port, timeout)
        return Rendezvous(f"file://{self._scratch}/store", timeout)

    def _launch(self) -> RankLauncher:
        parallel = self.config.parallel
        if parallel.distributed_executor_backend == "ray":
            from llmserve.worker.ray_launcher import RayRanks

            return RayRanks(self.config, self.rendezvous)
        return ProcessRanks(self.config, range(1, parallel.ranks_per_node), self.rendezvous)

    @property
    def remote_ranks(self) -> list[int]:
        """Ranks no launcher of this process started: those of other nodes' headless processes."""
        return [r for r in range(1, self.config.parallel.world_size) if r not in self.launcher.ranks]

    def wait_until_ready(self) -> None:
        """Wait until every rank has loaded its shard and passed the rendezvous, then join the group."""
        parallel = self.config.parallel
        failure = self.launcher.wait_loaded()
        if failure is None:
            try:
                info = rank_info(self.config, 0)
                same_host = admit(self._store, info, parallel.world_size, parallel.collective_timeout_seconds)
            except RendezvousError as error:
                failure = str(error)
        if failure is not None:
            self._failure = failure
            self.shutdown()
            raise TensorParallelError(failure)
        self._world.connect(
            self._store, self.config.model.device, parallel.collective_timeout_seconds, same_host
        )
        logger.info(
            "%d ranks (tensor parallel %d x pipeline parallel %d, %s), %d threads on rank 0%s",
            parallel.world_size,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            parallel.distributed_executor_backend,
            torch.get_num_threads(),
            "" if same_host else ", across hosts",
        )

    def execute(self, runner: ModelRunner, plan: StepPlan) -> ModelRunnerOutput:
        """Send the plan to every rank and run rank 0's shard; the others run theirs in step."""
        with self.step_guard():
            self.group.broadcast_bytes(self._encoder.encode(plan))
            start = time.perf_counter()
            output = runner.execute(plan)
        self.record_step(runner, time.perf_counter() - start)
        return output

    def record_step(self, runner: ModelRunner, seconds: float) -> None:
        """Rank 0's own step time, for its RankStats."""
        if self._meter is None:
            self._meter = RankMeter(0, runner)
        self._meter.add_step(seconds)
        if self._meter.report_due():  # as often as the workers report theirs
            self._own_stats = self._meter.snapshot()

    @contextlib.contextmanager
    def step_guard(self) -> Iterator[None]:
        """Around rank 0's part of a step: refuse it once a rank has failed, and turn any error
        inside into a `TensorParallelError` naming the rank that died, if one did."""
        if self.check_workers() is not None:
            raise TensorParallelError(self._failure)
        try:
            yield
        except Exception as error:
            # Whatever broke, the ranks are out of step now: a collective or a rank's work is missing.
            self._fail(self._dead_rank() or f"the step failed on rank 0: {error}")
            raise TensorParallelError(self._failure) from error

    @property
    def failure(self) -> str | None:
        """Why the group can no longer step (a rank exited, a collective failed); None while it can."""
        return self._failure

    def sentinels(self) -> list[int]:
        """Handles that become ready when a rank this process started exits (processes' sentinels)."""
        return self.launcher.sentinels() if self.launcher is not None else []

    def check_workers(self) -> str | None:
        """`failure`, after looking for a rank that has exited (then the others are stopped)."""
        if self._failure is None and not self._closed and (exited := self.launcher.exited()) is not None:
            self._fail(exited)
        return self._failure

    def rank_stats(self) -> tuple[RankStats, ...]:
        """Every rank's latest report (ranks that report none: their pid or nothing yet), with the exit
        code of those that exited."""
        reports = self.launcher.reports() if self.launcher is not None else {}
        stats = [self._own_stats or RankStats(0, os.getpid())]
        stats += [
            reports.get(rank) or RankStats(rank, 0) for rank in range(1, self.config.parallel.world_size)
        ]
        return tuple(stats)

    def _fail(self, failure: str) -> None:
        self._failure = failure
        logger.error("%s; stopping the other ranks", failure)
        self._stop_ranks()

    def _dead_rank(self) -> str | None:
        """The rank whose exit broke a step, if one turns up within the grace time."""
        deadline = time.monotonic() + _DEATH_GRACE_SECONDS
        remote = self.remote_ranks
        while True:
            if remote and (note := exit_note(self._store, remote)) is not None:
                return note
            wait = 0.2 if remote else _DEATH_GRACE_SECONDS
            if (local := self.launcher.wait_for_exit(wait)) is not None or time.monotonic() >= deadline:
                return local

    def shutdown(self) -> None:
        """Stop the ranks (the empty plan, then a kill for any that do not exit) and leave the group."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None and self._world.is_connected:
            with contextlib.suppress(Exception):
                self._world.broadcast_bytes(b"")
        self._stop_ranks()
        self._world.close()
        self._store = None  # a TCP store stops listening once dropped
        shutil.rmtree(self._scratch, ignore_errors=True)
        torch.set_num_threads(self._threads_before)

    def _stop_ranks(self) -> None:
        if self.launcher is not None:
            self.launcher.stop(_STOP_GRACE_SECONDS if self._failure is None else 0)
        if self._failure is not None:
            # ranks on other nodes, blocked in a collective, see their connections close and exit
            with contextlib.suppress(Exception):
                self._world.close()
