"""A tensor- or pipeline-parallel worker (ranks 1..N-1): its shard of the model, the rendezvous, then
the step loop.

The engine process (rank 0) schedules and samples; a worker holds its shard, its share of the KV
pool and its own copy of the requests' states. Each step it receives the plan rank 0 broadcasts
(msgspec bytes of the StepPlan), runs its shard with the all-reduces inside the layers, and sends
its vocabulary block of the logits to rank 0. Empty plan bytes stop it. Once a second at most,
after a step, a process started by the engine sends its own `RankStats` (metrics/ranks.py) up its
start-up pipe. Under pipeline parallelism the shard is its stage's part and the loop is
worker/pipeline_stage.py's.

Two kinds of process run this: a process started with multiprocessing (`run_worker`, by the engine
or by a headless node's `llmserve serve --headless`), and a Ray actor (worker/ray_launcher.py).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import time
from multiprocessing.connection import Connection

import msgspec
import torch

from llmserve.config import EngineConfig
from llmserve.core.step_plan import StepPlan
from llmserve.distributed.group import TensorParallelGroup
from llmserve.distributed.pipeline import PipelineGroup, PipelineLayout, PipelineStage
from llmserve.distributed.rendezvous import Rendezvous, RendezvousError, join, rank_info
from llmserve.log import configure_logging
from llmserve.metrics.ranks import RankMeter, ReportSink
from llmserve.worker.model_loading import load_model
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.parent_watch import exit_with_parent
from llmserve.worker.pipeline_stage import serve_stage

logger = logging.getLogger("llmserve")

REFUSED_EXIT_CODE = 4  # the rendezvous refused this rank (its error is logged)


def rank_groups(config: EngineConfig, rank: int) -> tuple[TensorParallelGroup, PipelineStage]:
    """Global `rank`'s tensor-parallel group handle and pipeline stage (tensor-parallel rank fastest)."""
    parallel = config.parallel
    layout = PipelineLayout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    group = TensorParallelGroup(
        layout.tp_rank_of(rank),
        parallel.tensor_parallel_size,
        parallel.enable_expert_parallel,
        parallel.all2all_backend,
    )
    stage = PipelineStage.of(
        config.model.arch.num_hidden_layers, layout.pipeline_parallel_size, layout.stage_of(rank)
    )
    return group, stage


def load_shard(
    config: EngineConfig, group: TensorParallelGroup, stage: PipelineStage | None = None
) -> ModelRunner:
    """This rank's shard of the checkpoint in a model, and the runner over it with its KV pool."""
    model = load_model(config.model, None, group, stage)  # as rank 0 does (llm_engine.py)
    runner = ModelRunner(config, model)
    # while rank 0 still loads: a prefault left running would share this rank's core with its first steps
    runner.wait_for_kv_prefault()
    return runner


def set_threads(config: EngineConfig) -> None:
    """This rank's intra-op threads (OpenMP keeps the count per calling thread)."""
    torch.set_num_threads(config.parallel.threads_per_rank())


def prepare_process(config: EngineConfig, device_index: int, log_level: int) -> EngineConfig:
    """Logging, threads and this rank's device (CUDA: one GPU per rank, `device_index` on its node)."""
    configure_logging(log_level)
    logger.setLevel(log_level)
    set_threads(config)
    if config.model.device.type != "cuda":
        return config
    device = torch.device("cuda", device_index)  # NCCL refuses two ranks on one GPU
    torch.cuda.set_device(device)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))


def join_and_serve(
    config: EngineConfig,
    rank: int,
    runner: ModelRunner,
    group: TensorParallelGroup,
    rendezvous: Rendezvous,
    status: ReportSink | None = None,
) -> None:
    """Pass the rendezvous's check, join the process group and run plans until the empty one."""
    parallel = config.parallel
    layout = PipelineLayout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    pipeline = PipelineGroup(layout, rank, group) if layout.pipeline_parallel_size > 1 else None
    world = pipeline or group
    store = rendezvous.join_store()
    same_host = join(store, rank_info(config, rank), rendezvous.timeout_seconds)
    world.connect(store, config.model.device, parallel.collective_timeout_seconds, same_host)
    if pipeline is None:
        serve_steps(runner, group, status)
    else:
        serve_stage(runner, pipeline, config, status)
    world.close()


def run_worker(
    config: EngineConfig,
    rank: int,
    rendezvous: Rendezvous,
    ready: Connection,
    log_level: int = logging.WARNING,
    device_index: int = 0,
) -> None:
    """A multiprocessing worker's entry point: `ready` gets None once its shard is loaded, else the error."""
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the engine decides
    config = prepare_process(config, device_index, log_level)
    group, stage = rank_groups(config, rank)
    try:
        runner = load_shard(config, group, stage)
    except BaseException as error:  # noqa: BLE001 - the engine raises it, one line, in its process
        ready.send(f"{type(error).__name__}: {error}")
        return
    ready.send(None)
    try:
        join_and_serve(config, rank, runner, group, rendezvous, status=ready)
    except RendezvousError as error:
        logger.error("llmserve: error: %s", error)
        sys.exit(REFUSED_EXIT_CODE)


def serve_steps(runner: ModelRunner, group: TensorParallelGroup, status: ReportSink | None = None) -> None:
    """Run rank 0's plans on this shard until the empty plan, reporting to `status` now and then."""
    decoder = msgspec.msgpack.Decoder(StepPlan)
    meter = RankMeter(group.rank, runner)
    while plan := group.broadcast_bytes(None):
        start = time.perf_counter()
        runner.execute(decoder.decode(plan))
        meter.add_step(time.perf_counter() - start)
        if status is not None and meter.report_due():
            status.send(meter.snapshot())
