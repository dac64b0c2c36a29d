"""The plan broadcast of distributed/group.py over a real gloo group of two processes: plans shorter
than, exactly as long as, and longer than the first broadcast's head arrive whole, and the empty plan
(the stop) arrives empty."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from datetime import timedelta

import pytest
import torch.distributed as dist

from llmserve.distributed.group import PLAN_HEAD_BYTES, TensorParallelGroup

pytestmark = pytest.mark.process

PLANS = [b"x", bytes(range(256)) * (PLAN_HEAD_BYTES // 256), os.urandom(3 * PLAN_HEAD_BYTES + 17), b""]


def _connect(rank: int, path: str) -> TensorParallelGroup:
    group = TensorParallelGroup(rank, 2)
    store = dist.FileStore(path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    group._plan_group = dist.new_group(backend="gloo")
    group.is_connected = True
    return group


def _receive(path: str, results) -> None:
    group = _connect(1, path)
    results.put([group.broadcast_bytes(None) for _ in PLANS])
    group.close()


def test_plans_of_every_length_arrive_whole():
    path = os.path.join(tempfile.mkdtemp(), "store")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    worker = context.Process(target=_receive, args=(path, results))
    worker.start()
    try:
        group = _connect(0, path)
        sent = [group.broadcast_bytes(plan) for plan in PLANS]
        received = results.get(timeout=60)
        group.close()
    finally:
        worker.join(timeout=30)
        if worker.is_alive():
            worker.kill()
    assert sent == PLANS and received == PLANS
