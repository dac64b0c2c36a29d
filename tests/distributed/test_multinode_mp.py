"""`--distributed-executor-backend mp` over two "nodes" of this machine: node 0 is this process's
engine (rank 0), node 1 a `llmserve serve --headless --node-rank 1` process whose rank joins over
TCP. Greedy tokens equal one process's; the rendezvous refuses a node with another block size in
one line; a rank killed on node 1 is named by rank 0 and node 1's process exits with an error."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve import LLM, SamplingParams
from llmserve.worker.executor import TensorParallelError
from tests.distributed.conftest import ENGINE_KWARGS, assert_same_greedy, engine
from tests.distributed.test_tensor_parallel import PROMPTS
from tests.helpers import make_tiny_llama_dir

pytestmark = pytest.mark.process

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _node_flags(port: int, node_rank: int) -> list[str]:
    return [
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]


def _start_headless(
    model_dir: str, port: int, *extra: str, tensor_parallel_size: int = 2
) -> subprocess.Popen:
    command = [sys.executable, "-m", "llmserve.cli", "serve", "--headless", "--model", model_dir]
    command += [
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
    ]
    command += ["--kv-cache-memory", "8MiB", *_node_flags(port, 1), *extra]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True)


def _node0(model_dir: str, port: int, tensor_parallel_size: int = 2) -> LLM:
    kwargs = dict(
        nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, distributed_timeout_seconds=120
    )
    return LLM(model_dir, tensor_parallel_size=tensor_parallel_size, **ENGINE_KWARGS, **kwargs)


def _ranks_of(pid: int) -> list[int]:
    """The rank processes a headless node started (multiprocessing's resource tracker left out)."""
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        pids = [int(child) for child in children.read().split()]
    return [child for child in pids if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def test_two_nodes_give_one_process_greedy_tokens_and_node_1_exits_with_the_engine(tiny_llama_dir):
    with engine(tiny_llama_dir) as llm:
        reference = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    port = _free_port()
    node1 = _start_headless(tiny_llama_dir, port)
    try:
        llm = _node0(tiny_llama_dir, port)
        try:
            outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            executor = llm.engine.executor
            assert executor.remote_ranks == [1] and executor.launcher.processes == []
            assert executor.group.same_host  # two "nodes" of one machine
        finally:
            llm.shutdown()
        node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert node1.returncode == 0
    for want, got in zip(reference, outputs, strict=True):
        assert_same_greedy(want, got)


def test_a_rank_killed_on_node_1_is_named_by_rank_0_and_ends_node_1(tiny_llama_dir):
    port = _free_port()
    node1 = _start_headless(tiny_llama_dir, port)
    try:
        llm = _node0(tiny_llama_dir, port)
        try:
            llm.engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
            llm.engine.step()
            (rank1,) = _ranks_of(node1.pid)
            os.kill(rank1, signal.SIGKILL)
            for _ in range(2):  # and every step after it
                with pytest.raises(
                    TensorParallelError,
                    match=rf"^tensor-parallel rank 1 \(pid {rank1}\) exited with code -9$",
                ):
                    llm.engine.step()
        finally:
            llm.shutdown()
        _, err = node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert node1.returncode == 2
    assert f"llmserve: error: tensor-parallel rank 1 (pid {rank1}) exited with code -9" in err


def test_a_node_with_another_block_size_is_refused_in_one_line_on_both_nodes(tiny_llama_dir):
    port = _free_port()
    node1 = _start_headless(tiny_llama_dir, port, "--block-size", "16")
    try:
        with pytest.raises(TensorParallelError) as error:
            _node0(tiny_llama_dir, port)
        _, err = node1.communicate(timeout=60)
    finally:
        node1.kill()
    line = str(error.value)
    assert "\n" not in line
    assert "rank 1 on" in line and "has block_size=16, rank 0 on" in line and "has block_size=32" in line
    assert node1.returncode == 2 and line in err  # the node's rank logged the same verdict


def test_when_a_rank_of_node_0_dies_the_ranks_of_node_1_exit_too(tmp_path):
    """TP=4 over two nodes (a model with 4 KV heads): rank 1, node 0's worker, is killed; rank 0 tears
    the group down, and node 1's ranks 2 and 3, which no one kills, exit and end node 1."""
    model_dir = make_tiny_llama_dir(
        str(tmp_path / "four-kv-heads"), num_attention_heads=4, num_key_value_heads=4
    )
    port = _free_port()
    node1 = _start_headless(model_dir, port, tensor_parallel_size=4)
    try:
        llm = _node0(model_dir, port, tensor_parallel_size=4)
        try:
            llm.engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
            llm.engine.step()
            (rank1,) = llm.engine.executor.launcher.processes
            os.kill(rank1.pid, signal.SIGKILL)
            with pytest.raises(
                TensorParallelError, match=r"^tensor-parallel rank 1 \(pid \d+\) exited with code -9$"
            ):
                llm.engine.step()
            node1.communicate(timeout=60)
        finally:
            llm.shutdown()
    finally:
        node1.kill()
    assert node1.returncode == 2
