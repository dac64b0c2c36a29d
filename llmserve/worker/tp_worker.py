"""A tensor-parallel worker process (ranks 1..N-1): its shard of the model, then the step loop.

The engine process (rank 0) schedules and samples; a worker holds its shard, its share of the KV
pool and its own copy of the requests' states. Each step it receives the plan rank 0 broadcasts
(msgspec bytes of the StepPlan), runs its shard with the all-reduces inside the layers, and sends
its vocabulary block of the logits to rank 0. Empty plan bytes stop it.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from multiprocessing.connection import Connection

import msgspec
import torch

from llmserve.config import EngineConfig
from llmserve.core.step_plan import StepPlan
from llmserve.distributed.group import TensorParallelGroup
from llmserve.kernels.small_batch_linear import use_small_batch_linear
from llmserve.log import configure_logging
from llmserve.model_loader import load_weights
from llmserve.models.registry import build_model
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.parent_watch import exit_with_parent

logger = logging.getLogger("llmserve")


def load_shard(config: EngineConfig, group: TensorParallelGroup) -> ModelRunner:
    """This rank's shard of the checkpoint in a model, and the runner over it with its KV pool."""
    model_config = config.model
    model = build_model(model_config, load_weights(model_config.path, model_config.dtype), group)
    if model_config.quantization is not None:  # as rank 0 does (llm_engine.py)
        from llmserve.quantization.sharding import quantize_shard

        quantize_shard(
            model,
            model_config,
            None,
            lambda: build_model(model_config, load_weights(model_config.path, model_config.dtype)),
        )
    use_small_batch_linear(model)  # CPU: packed weight layouts, as the engine's rank does
    return ModelRunner(config, model)


def run_worker(
    config: EngineConfig, rank: int, init_method: str, ready: Connection, log_level: int = logging.WARNING
) -> None:
    """The worker process's entry point: `ready` gets None once its shard is loaded, else the error."""
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the engine decides
    configure_logging(log_level)
    logger.setLevel(log_level)
    torch.set_num_threads(config.parallel.threads_per_rank())
    if config.model.device.type == "cuda":  # one GPU per rank (NCCL refuses two ranks on one)
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))
    group = TensorParallelGroup(rank, config.parallel.world_size)
    try:
        runner = load_shard(config, group)
    except BaseException as error:  # noqa: BLE001 - the engine raises it, one line, in its process
        ready.send(f"{type(error).__name__}: {error}")
        return
    ready.send(None)
    group.connect(init_method, config.model.device, config.parallel.collective_timeout_seconds)
    serve_steps(runner, group)
    group.close()


def serve_steps(runner: ModelRunner, group: TensorParallelGroup) -> None:
    """Run rank 0's plans on this shard until the empty plan."""
    decoder = msgspec.msgpack.Decoder(StepPlan)
    while plan := group.broadcast_bytes(None):
        runner.execute(decoder.decode(plan))
