"""Pipeline parallelism: which ranks form which stage, which layers a stage holds, and the
point-to-point messages between stages.

Ranks are laid out as vLLM's: the tensor-parallel rank varies fastest, so global rank
r = stage * T + tp_rank, and rank 0 (the engine process) is stage 0's first rank. The decoder
layers split into P contiguous runs (config/parallel.py: `stage_layer_ranges`); stage 0 also holds
the embedding, the last stage the final norm and the output projection.

What crosses between ranks (`PipelineGroup`), in the order rank 0 submits batches, so every pair
of ranks matches its messages first in, first out:

- rank 0 -> every other rank: each batch's plan (msgspec bytes, length first), on a gloo group;
- stage s, tp rank t -> stage s + 1, tp rank t: the batch's hidden states [tokens, hidden] (each
  tp rank holds all of them after its stage's last all-reduce);
- the last stage's first rank -> rank 0: the sampling rows' logits [rows, vocab] in float32, or a
  one-element acknowledgement for a batch without a sampling row.

Activations and logits go on the device's backend (gloo on a CPU, NCCL on CUDA); the receiver
knows every shape from the plan it holds, so no shape travels.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from llmserve.config.parallel import stage_layer_ranges
from llmserve.distributed.group import TensorParallelGroup

# A worker waits for the next plan as long as the engine idles (see group.py's _IDLE_WAIT).
_IDLE_WAIT = timedelta(days=365)


@dataclass(frozen=True)
class PipelineStage:
    """The part of the model one rank builds: its stage's layers, the embedding on the first stage,
    the final norm and output projection on the last."""

    stage: int
    num_stages: int
    layers: range

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        return cls(0, 1, range(num_layers))

    @classmethod
    def of(cls, num_layers: int, num_stages: int, stage: int) -> PipelineStage:
        return cls(stage, num_stages, stage_layer_ranges(num_layers, num_stages)[stage])

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass(frozen=True)
class PipelineLayout:
    """Global ranks of a T x P world, tensor-parallel rank fastest."""

    tensor_parallel_size: int
    pipeline_parallel_size: int

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def rank_of(self, stage: int, tp_rank: int = 0) -> int:
        return stage * self.tensor_parallel_size + tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank_of(stage, tp_rank) for tp_rank in range(self.tensor_parallel_size)]


@dataclass
class PendingSend:
    """A send in progress and the tensor it reads, kept alive until it completes."""

    work: dist.Work
    tensor: torch.Tensor

    def wait(self) -> None:
        self.work.wait()

    @property
    def is_done(self) -> bool:
        return self.work.is_completed()


class PipelineGroup:
    """One rank's process groups under pipeline parallelism and its messages to other stages."""

    def __init__(self, layout: PipelineLayout, rank: int, tp: TensorParallelGroup) -> None:
        self.layout = layout
        self.rank = rank
        self.stage = layout.stage_of(rank)
        self.tp = tp  # its stage's tensor-parallel group, bound to a subgroup once connected
        self._plan_group = None
        self.is_connected = False

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.layout.pipeline_parallel_size - 1

    def connect(
        self, store: dist.Store, device: torch.device, timeout_seconds: float, same_host: bool = True
    ) -> None:
        """Join the world at rank 0's `store` (blocks until every rank has called it), then make every
        stage's tensor-parallel group (every rank makes every group, in one order, as torch requires)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        layout, timeout = self.layout, timedelta(seconds=timeout_seconds)
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=layout.world_size, timeout=timeout
        )
        self.tp.same_host = same_host
        for stage in range(layout.pipeline_parallel_size):
            group = dist.new_group(layout.stage_ranks(stage), timeout=timeout)
            if stage == self.stage:
                self.tp.bind(group, layout.rank_of(stage))
        self._plan_group = dist.new_group(backend="gloo", timeout=_IDLE_WAIT)
        self.is_connected = True

    def close(self) -> None:
        if self.is_connected:
            dist.destroy_process_group()
            self.is_connected = False

    # -- plans: rank 0 to every other rank ---------------------------------------------------------

    def send_plan(self, data: bytes) -> list[PendingSend]:
        """Rank 0: queue `data` for every other rank (empty: stop)."""
        length = torch.tensor([len(data)], dtype=torch.int64)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
        sends = []
        for rank in range(1, self.layout.world_size):
            sends.append(PendingSend(dist.isend(length, rank, group=self._plan_group), length))
            if payload is not None:
                sends.append(PendingSend(dist.isend(payload, rank, group=self._plan_group), payload))
        return sends

    def broadcast_bytes(self, data: bytes) -> None:
        """Rank 0: `data` to every other rank, waiting until it is sent (the executor's stop)."""
        for send in self.send_plan(data):
            send.wait()

    def recv_plan(self) -> bytes:
        """A worker: the next plan's bytes from rank 0 (empty: stop)."""
        length = torch.empty(1, dtype=torch.int64)
        dist.recv(length, 0, group=self._plan_group)
        if not int(length):
            return b""
        payload = torch.empty(int(length), dtype=torch.uint8)
        dist.recv(payload, 0, group=self._plan_group)
        return payload.numpy().tobytes()

    # -- activations: stage s to stage s + 1, tp rank to tp rank -----------------------------------

    def send_activations(self, hidden: torch.Tensor) -> PendingSend:
        """Queue the stage's output for the next stage's rank of this tp rank."""
        peer = self.layout.rank_of(self.stage + 1, self.layout.tp_rank_of(self.rank))
        hidden = hidden.contiguous()
        return PendingSend(dist.isend(hidden, peer), hidden)

    def recv_activations(self, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` with the previous stage's output for this batch."""
        dist.recv(out, self.layout.rank_of(self.stage - 1, self.layout.tp_rank_of(self.rank)))
        return out

    # -- results: the last stage's first rank to rank 0 --------------------------------------------

    def send_result(self, result: torch.Tensor) -> PendingSend:
        """Queue a batch's logits (or acknowledgement) for rank 0."""
        result = result.contiguous()
        return PendingSend(dist.isend(result, 0), result)

    def recv_result(self, out: torch.Tensor) -> torch.Tensor:
        dist.recv(out, self.layout.rank_of(self.layout.pipeline_parallel_size - 1))
        return out
