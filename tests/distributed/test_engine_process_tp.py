"""The server's engine process with tensor-parallel workers as its children: it serves, a worker's
death fails the requests in flight with the rank named, and workers never outlive the engine."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from llmserve import SamplingParams
from llmserve.config import EngineArgs
from llmserve.engine.async_llm import AsyncLLM, EngineFailedError
from tests.distributed.conftest import ENGINE_KWARGS
from tests.helpers import is_alive, wait_until

pytestmark = pytest.mark.process

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [int(child) for child in children.read().split()]


async def _stream_and_kill(llm: AsyncLLM, worker: int) -> int:
    """Stream a long request, SIGKILL the worker after its first tokens; the tokens it got."""
    received = 0
    async for output in llm.generate([5, 6, 7], LONG, "r"):
        received = len(output.outputs[0].token_ids)
        if received >= 2:
            os.kill(worker, signal.SIGKILL)
    return received


async def _collect(llm: AsyncLLM) -> list:
    return [output async for output in llm.generate([5, 6, 7], LONG, "r2")]


@pytest.fixture
def tp_engine(tiny_llama_dir):
    llm = AsyncLLM(EngineArgs(model=tiny_llama_dir, tensor_parallel_size=2, **ENGINE_KWARGS))
    yield llm
    llm.shutdown()


def test_a_dead_worker_fails_the_streams_in_flight_with_the_rank_named(tp_engine):
    (worker,) = _children(tp_engine.engine_core.pid)
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 .* exited with code -9"):
        asyncio.run(asyncio.wait_for(_stream_and_kill(tp_engine, worker), timeout=120))
    assert not is_alive(worker)
    # the engine process lives on and answers every later request with the same error, at once
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
        asyncio.run(asyncio.wait_for(_collect(tp_engine), timeout=30))


def test_a_worker_exits_with_its_engine_process(tp_engine):
    (worker,) = _children(tp_engine.engine_core.pid)
    assert is_alive(worker)  # so that its exit below is the engine process's doing
    os.kill(tp_engine.engine_core.pid, signal.SIGKILL)
    assert wait_until(lambda: not is_alive(worker), 30, "the worker to exit with its engine process")


def test_a_worker_that_dies_while_the_engine_idles_is_reported_at_once(tp_engine):
    (worker,) = _children(tp_engine.engine_core.pid)
    assert tp_engine.failure is None
    os.kill(worker, signal.SIGKILL)
    # no request is needed to find it: the engine waits on it too
    wait_until(lambda: tp_engine.failure is not None, 30, "the dead worker's report")
    assert tp_engine.failure == f"tensor-parallel rank 1 (pid {worker}) exited with code -9"
    assert [rank.exit_code for rank in tp_engine.gauges.ranks] == [None, -9]
    with pytest.raises(EngineFailedError, match="tensor-parallel rank 1"):
        asyncio.run(asyncio.wait_for(_collect(tp_engine), timeout=30))
