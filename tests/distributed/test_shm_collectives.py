"""The shared-memory collectives of ranks on one host (kernels/csrc/shm_collectives.cpp).

This process is rank 0 and creates the segment; the other ranks are spawned processes that open it.
Every call's inputs are drawn from a seed of (rank, call), so each rank can tell what the others
sent: the sums must be the float32 sum in rank order (rounded once to bf16) on every rank, over
enough calls of changing sizes that both slots are reused many times.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid

import pytest
import torch

from llmserve.kernels.cpu_ops import load_cpu_ops
from tests.helpers import wait_until

pytestmark = pytest.mark.cpu_kernels

CALLS = 300
SLOT_BYTES = 1 << 16


def _inputs(rank: int, call: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank * 100_003 + call)
    numel = 1 + (call * 37) % 4000  # up to 16 KB of float32: within the slot
    dtype = torch.bfloat16 if call % 3 else torch.float32
    return torch.randn(numel, generator=generator).to(dtype)


def _expected_sum(world_size: int, call: int) -> torch.Tensor:
    parts = [_inputs(rank, call) for rank in range(world_size)]
    total = torch.zeros(parts[0].shape, dtype=torch.float32)
    for part in parts:
        total += part.float()
    return total.to(parts[0].dtype)


def _run_rank(path: str, rank: int, world_size: int, results) -> None:
    ops = load_cpu_ops()
    shm = ops.ShmCollectives(path, rank, world_size, SLOT_BYTES, 30.0, False)
    mismatches = 0
    for call in range(CALLS):
        if call % 10 == 9:
            shm.gather_to_first(torch.full((2, 3), float(rank)))
            continue
        tensor = _inputs(rank, call)
        shm.all_reduce(tensor)
        mismatches += not torch.equal(tensor, _expected_sum(world_size, call))
    results.put((rank, mismatches))


@pytest.mark.process
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_and_gather_agree_with_the_rank_ordered_sum_on_every_rank(world_size):
    ops = load_cpu_ops()
    path = f"/dev/shm/llmserve-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    shm = ops.ShmCollectives(path, 0, world_size, SLOT_BYTES, 30.0, True)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [
        context.Process(target=_run_rank, args=(path, rank, world_size, results))
        for rank in range(1, world_size)
    ]
    try:
        for worker in workers:
            worker.start()
        mismatches = 0
        for call in range(CALLS):
            if call % 10 == 9:
                gathered = shm.gather_to_first(torch.full((2, 3), 0.0))
                want = torch.cat([torch.full((2, 3), float(rank)) for rank in range(world_size)], dim=-1)
                assert torch.equal(gathered, want)
                continue
            tensor = _inputs(0, call)
            shm.all_reduce(tensor)
            mismatches += not torch.equal(tensor, _expected_sum(world_size, call))
        others = dict(results.get(timeout=60) for _ in workers)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
        os.unlink(path)
    assert mismatches == 0
    assert others == {rank: 0 for rank in range(1, world_size)}


def test_a_rank_that_never_arrives_fails_the_call_naming_it():
    ops = load_cpu_ops()
    path = f"/dev/shm/llmserve-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    shm = ops.ShmCollectives(path, 0, 2, SLOT_BYTES, 0.3, True)
    os.unlink(path)  # the mapping stays
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 did not reach collective 1 within 0.3 s"):
        shm.all_reduce(torch.ones(4))
    with pytest.raises(RuntimeError, match="exceed the slot"):
        shm.all_reduce(torch.ones(SLOT_BYTES))


def test_a_segment_of_another_size_is_refused():
    ops = load_cpu_ops()
    path = f"/dev/shm/llmserve-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ops.ShmCollectives(path, 0, 2, SLOT_BYTES, 1.0, True)
    try:
        with pytest.raises(RuntimeError, match="is not a segment of"):
            ops.ShmCollectives(path, 1, 2, 2 * SLOT_BYTES, 1.0, False)
    finally:
        os.unlink(path)


def _map_and_exit(path: str) -> None:
    load_cpu_ops().ShmCollectives(path, 1, 2, SLOT_BYTES, 30.0, False)


@pytest.mark.process
def test_a_rank_that_died_fails_the_call_at_once_naming_it():
    ops = load_cpu_ops()
    path = f"/dev/shm/llmserve-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    shm = ops.ShmCollectives(path, 0, 2, SLOT_BYTES, 60.0, True)
    worker = multiprocessing.get_context("spawn").Process(target=_map_and_exit, args=(path,))
    worker.start()  # not joined until the end: it stays a zombie, which counts as dead too
    try:
        exited = lambda: os.path.exists(f"/proc/{worker.pid}") and _state(worker.pid) == "Z"  # a zombie
        wait_until(exited, 60, "the worker to exit")
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"tensor-parallel rank 1 \(pid {worker.pid}\) exited"):
            shm.all_reduce(torch.ones(4))
        assert time.monotonic() - started < 10  # not the 60 s timeout
    finally:
        worker.join()
        os.unlink(path)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]
