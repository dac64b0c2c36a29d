"""Rank 0's side of tensor and pipeline parallelism: the worker processes, each step's plan to them,
their health.

The engine process is rank 0: it schedules, runs its own shard and samples. The executor starts
ranks 1..N-1 (spawned, each `tp_worker.run_worker`), which load their shards while rank 0 loads
its own; `wait_until_ready` then joins the process group. Each step it broadcasts the plan and runs
rank 0's runner; the collectives inside the forward keep the ranks in step. Under pipeline
parallelism the engine drives the stages through worker/pipeline_stage.py instead, inside
`step_guard` as well.

Failure: a worker that exits (found before a step, or by the collective it breaks) or a collective
that times out fails the step with a `TensorParallelError` naming the rank, and every later step
with the same error: the group cannot be resynchronized, so the workers are stopped.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import shutil
import tempfile
from collections.abc import Iterator
from multiprocessing.connection import wait

import msgspec
import torch

from llmserve.config import EngineConfig
from llmserve.core.step_plan import StepPlan
from llmserve.distributed.group import TensorParallelGroup
from llmserve.distributed.pipeline import PipelineGroup, PipelineLayout
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
        self.group = TensorParallelGroup(0, parallel.tensor_parallel_size)  # stage 0's ranks
        layout = PipelineLayout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.pipeline = PipelineGroup(layout, 0, self.group) if layout.pipeline_parallel_size > 1 else None
        self._world = self.pipeline or self.group  # what this rank joins, stops and leaves
        self._rendezvous = tempfile.mkdtemp(prefix="llmserve-tp-")  # the ranks meet at a file store
        self._init_method = f"file://{self._rendezvous}/store"
        self._failure: str | None = None
        self._closed = False
        self._encoder = msgspec.msgpack.Encoder()
        context = multiprocessing.get_context("spawn")  # a fork would copy OpenMP's threads' state
        self.workers: list[multiprocessing.Process] = []
        self._ready = []
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
        self._world.connect(self._init_method, self.config.model.device, parallel.collective_timeout_seconds)
        logger.info(
            "%d ranks (tensor parallel %d x pipeline parallel %d), %d threads each",
            parallel.world_size,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            torch.get_num_threads(),
        )

    def execute(self, runner: ModelRunner, plan: StepPlan) -> ModelRunnerOutput:
        """Send the plan to every worker and run rank 0's shard; the workers run theirs in step."""
        with self.step_guard():
            self.group.broadcast_bytes(self._encoder.encode(plan))
            return runner.execute(plan)

    @contextlib.contextmanager
    def step_guard(self) -> Iterator[None]:
        """Around rank 0's part of a step: refuse it once a rank has failed, and turn any error
        inside into a `TensorParallelError` naming the rank that died, if one did."""
        if self._failure is None:
            self._failure = self._exited_workers()
        if self._failure is not None:
            raise TensorParallelError(self._failure)
        try:
            yield
        except Exception as error:
            # Whatever broke, the ranks are out of step now: a collective or a rank's work is missing.
            # a peer's death reaches rank 0 as a reset connection, maybe before its exit is reaped
            wait([worker.sentinel for worker in self.workers], timeout=_DEATH_GRACE_SECONDS)
            self._failure = self._exited_workers() or f"tensor-parallel step failed on rank 0: {error}"
            self._stop_workers()
            raise TensorParallelError(self._failure) from error

    def shutdown(self) -> None:
        """Stop the workers (the empty plan, then a kill for any that do not exit) and leave the group."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None and self._world.is_connected:
            with contextlib.suppress(Exception):
                self._world.broadcast_bytes(b"")
        self._stop_workers()
        self._world.close()
        shutil.rmtree(self._rendezvous, ignore_errors=True)
        torch.set_num_threads(self._threads_before)

    def _stop_workers(self) -> None:
        for worker in self.workers:
            worker.join(_STOP_GRACE_SECONDS if self._failure is None else 0)
            if worker.is_alive():
                worker.kill()
                worker.join()

    def _exited_workers(self) -> str | None:
        exited = [
            (rank, worker) for rank, worker in enumerate(self.workers, start=1) if not worker.is_alive()
        ]
        if not exited:
            return None
        rank, worker = exited[0]
        return f"tensor-parallel rank {rank} (pid {worker.pid}) exited with code {worker.exitcode}"
