"""One rank's handle on the tensor-parallel group: its rank, and every collective the engine runs.

Built on torch.distributed: gloo on a CPU, NCCL on CUDA for the tensors; step plans cross on a
second, gloo group, as bytes on the CPU. The forward's collectives have the group's timeout, so a
hung rank fails the step instead of stalling it; waiting for the next plan has none worth the name,
since an idle engine sends no plans. A group of one rank (`single_rank()`) is the engine without
tensor parallelism: its collectives return their input and touch no process group.

The group is made before the process group is joined (`connect`): a rank builds its model first, and
the engine joins only once every worker has loaded, so a worker that fails to load cannot leave
the others waiting in the rendezvous. The ranks meet at rank 0's store (distributed/rendezvous.py),
which also tells each whether all ranks share one host (`same_host`).

Ranks on one host (all of them, on the CPU) also share a segment of shared memory
(kernels/csrc/shm_collectives.cpp): the all-reduces and the logits gather of a step go through it,
a few microseconds each instead of gloo's socket round trips, and the fused decode stack calls it
from C++. A tensor larger than its slot, or ranks on several hosts, take gloo.
"""

from __future__ import annotations

import logging
import os
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from llmserve.kernels.cpu_ops import load_cpu_ops

logger = logging.getLogger("llmserve")

# A worker waits for the next plan as long as the engine idles; it exits with the engine regardless
# (worker/parent_watch.py), and a rank that hangs mid-step is caught by the forward's collectives.
_IDLE_WAIT = timedelta(days=365)
# Each rank's slot in the shared segment (two per rank): a decode step's logits at batch 32 over
# half of a 49k vocabulary in float32 fit, and so do the hidden states of a 2k-token prefill chunk.
SHM_SLOT_BYTES = 4 << 20
# A decode step's plan (a few bytes per request) fits in one broadcast of this many bytes.
PLAN_HEAD_BYTES = 4096


class TensorParallelGroup:
    def __init__(
        self, rank: int, world_size: int, expert_parallel: bool = False, all2all_backend: str = "naive"
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.expert_parallel = expert_parallel  # MoE layers split experts, not units (expert_parallel.py)
        self.all2all_backend = all2all_backend  # how expert parallelism dispatches (config/parallel.py)
        self._plan_group = None  # the gloo group the plan bytes cross on, on the CPU whatever the device
        self._device_group = None  # the forward's collectives (None: the default group, every rank)
        self._first_global_rank = 0  # rank 0 of this group in the world's numbering
        self.is_connected = False
        self.same_host = True  # every rank on one machine (shared memory can carry the collectives)
        self.shm = None  # kernels' ShmCollectives once connected, where every rank is on this host's CPU

    @property
    def is_first_rank(self) -> bool:
        """Rank 0: the engine process, which schedules, samples and receives the gathered logits."""
        return self.rank == 0

    def connect(
        self, store: dist.Store, device: torch.device, timeout_seconds: float, same_host: bool = True
    ) -> None:
        """Join the process group at `store` (blocks until every rank has called it, at most the
        timeout); `same_host` as the rendezvous found it."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_seconds)
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )
        self.same_host = same_host
        self._plan_group = dist.new_group(backend="gloo", timeout=_IDLE_WAIT)
        self.is_connected = True
        if device.type == "cpu":
            self.shm = self._map_shared_segment(timeout_seconds)

    def _map_shared_segment(self, timeout_seconds: float):
        """The shared-memory collectives, where every rank runs on this host and the kernels built;
        else None (gloo for everything)."""
        ops = load_cpu_ops()
        usable = ops is not None and hasattr(ops, "ShmCollectives")
        flags = [None] * self.world_size
        dist.all_gather_object(flags, usable, group=self._plan_group)
        if not self.same_host or not all(flags):
            return None
        path = self.broadcast_bytes(
            f"/dev/shm/llmserve-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
            if self.is_first_rank
            else None
        ).decode()
        error = None
        if self.is_first_rank:
            try:
                shm = ops.ShmCollectives(path, 0, self.world_size, SHM_SLOT_BYTES, timeout_seconds, True)
            except RuntimeError as failure:  # /dev/shm full or missing: gloo still works
                shm, error = None, str(failure).splitlines()[0]
        created = [None] * self.world_size
        dist.all_gather_object(
            created, shm is not None if self.is_first_rank else True, group=self._plan_group
        )
        if not created[0]:
            if error is not None:
                logger.warning("tensor parallelism without shared memory (gloo only): %s", error)
            return None
        if not self.is_first_rank:
            shm = ops.ShmCollectives(path, self.rank, self.world_size, SHM_SLOT_BYTES, timeout_seconds, False)
        dist.barrier(group=self._plan_group)  # every rank has mapped it: the name can go
        if self.is_first_rank:
            os.unlink(path)
        return shm

    def bind(self, device_group, first_global_rank: int) -> None:
        """Pipeline parallelism: run the forward's collectives on this stage's subgroup of the world
        (distributed/pipeline.py joined it; plans reach this rank from there), over gloo: the shared
        segment is not mapped for a stage's ranks yet."""
        self._device_group, self._first_global_rank = device_group, first_global_rank

    def close(self) -> None:
        if self.is_connected:
            self.is_connected = False  # first: a group torn down after a failure may raise here
            self.shm = None
            dist.destroy_process_group()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place (a row-parallel layer's partial outputs)."""
        if self.world_size > 1:
            if self._fits_shm(tensor) and tensor.dtype in (torch.float32, torch.bfloat16):
                self.shm.all_reduce(tensor)
            else:
                dist.all_reduce(tensor, group=self._device_group)
        return tensor

    def _fits_shm(self, tensor: torch.Tensor) -> bool:
        # the same answer on every rank: the tensors of one collective have one shape and dtype
        return (
            self.shm is not None
            and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() <= SHM_SLOT_BYTES
        )

    def all_to_all(self, tensor: torch.Tensor, out_rows: list[int], in_rows: list[int]) -> torch.Tensor:
        """Rows in_rows[r] of `tensor` (in rank order) go to rank r; the rows every rank sends here,
        out_rows[r] from rank r, come back concatenated in rank order (gloo or NCCL alike)."""
        if self.world_size == 1:
            return tensor
        out = tensor.new_empty((sum(out_rows), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), out_rows, in_rows, group=self._device_group)
        return out

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's tensor (one shape on all) concatenated along the last dimension on rank 0;
        None on the others."""
        if self.world_size == 1:
            return tensor
        if self._fits_shm(tensor):
            gathered = self.shm.gather_to_first(tensor)
            return gathered if self.is_first_rank else None
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.is_first_rank else None
        dist.gather(tensor.contiguous(), parts, dst=self._first_global_rank, group=self._device_group)
        return torch.cat(parts, dim=-1) if self.is_first_rank else None

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (the others pass None). One broadcast of a fixed head (the
        length, then up to PLAN_HEAD_BYTES of data: a decode step's whole plan), a second for the rest
        of a longer one: each broadcast is a round trip the step waits for."""
        head = torch.zeros(8 + PLAN_HEAD_BYTES, dtype=torch.uint8)
        if self.is_first_rank:
            head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
            first = data[:PLAN_HEAD_BYTES]
            if first:
                head[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        dist.broadcast(head, src=0, group=self._plan_group)
        if self.is_first_rank:
            rest = data[PLAN_HEAD_BYTES:]
            if rest:
                dist.broadcast(
                    torch.frombuffer(bytearray(rest), dtype=torch.uint8), src=0, group=self._plan_group
                )
            return data
        length = int(head[:8].view(torch.int64))
        received = head[8 : 8 + min(length, PLAN_HEAD_BYTES)].numpy().tobytes()
        if length > PLAN_HEAD_BYTES:
            rest = torch.empty(length - PLAN_HEAD_BYTES, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self._plan_group)
            received += rest.numpy().tobytes()
        return received


def single_rank() -> TensorParallelGroup:
    """The group of an engine without tensor parallelism."""
    return TensorParallelGroup(0, 1)
