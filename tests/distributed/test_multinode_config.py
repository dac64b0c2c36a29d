"""Multi-node bad input, each a one-line error, and the rendezvous's check, without a cluster: the
flags' constraints, a rank whose versions or block size differ from rank 0's, a rank that never
comes, a rendezvous address or Ray cluster that does not answer."""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
import torch

from llmserve.cli.main import main as cli_main
from llmserve.config import EngineArgs
from llmserve.distributed.rendezvous import (
    RankInfo,
    Rendezvous,
    RendezvousError,
    admit,
    join,
    mismatch,
    rank_info,
)
from llmserve.worker.ray_launcher import connect_ray
from tests.distributed.test_shard import ARCH


def _config(**kwargs):
    return EngineArgs(**{"tensor_parallel_size": 2, **kwargs}).create_config(ARCH, "model")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(node_rank=1), "--node-rank needs --nnodes"),
        (dict(nnodes=2, master_addr="10.0.0.1"), "--nnodes 2 needs --node-rank"),
        (dict(nnodes=2, node_rank=0), "--nnodes needs --master-addr"),
        (dict(nnodes=2, node_rank=2, master_addr="h"), r"--node-rank must be in \[0, 2\), got 2"),
        (dict(nnodes=0), "--nnodes must be >= 1"),
        (dict(tensor_parallel_size=3, nnodes=2, node_rank=0, master_addr="h"), "does not split over"),
        (dict(nnodes=2, node_rank=0, master_addr="h", master_port=70000), "--master-port must be in"),
        (dict(distributed_executor_backend="ray", nnodes=2, node_rank=0), "Ray places the ranks"),
    ],
)
def test_multinode_flags_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        _config(**kwargs)
    assert "\n" not in str(error.value)


def test_the_ranks_of_each_node_and_their_threads():
    parallel = _config(tensor_parallel_size=3, nnodes=3, node_rank=2, master_addr="h").parallel
    assert (parallel.ranks_per_node, parallel.node_ranks, parallel.master_port) == (1, range(2, 3), 29501)
    parallel = _config(nnodes=2, node_rank=0, master_addr="10.0.0.1", master_port=1234).parallel
    assert (parallel.node_ranks, parallel.master_addr, parallel.master_port) == (
        range(0, 1),
        "10.0.0.1",
        1234,
    )


def test_ray_not_installed_is_one_line(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "ray" else find_spec(name))
    with pytest.raises(ValueError, match=r"needs Ray, which is not installed: pip install 'llmserve\[ray\]'"):
        _config(distributed_executor_backend="ray")


def test_a_ray_address_that_does_not_answer_is_one_line_within_seconds(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_closed_port()}")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"the Ray cluster at RAY_ADDRESS=127\.0\.0\.1:\d+ does not answer"):
        connect_ray(5.0)
    assert time.monotonic() - start < 15


def test_a_rendezvous_that_does_not_answer_is_one_line_after_its_timeout():
    rendezvous = Rendezvous.tcp("127.0.0.1", _closed_port(), 0.5)
    with pytest.raises(
        RendezvousError, match=r"node 0's rendezvous at 127\.0\.0\.1:\d+ did not answer within 0\.5 s"
    ):
        rendezvous.join_store()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_mismatch_names_both_ranks_and_what_differs():
    first = rank_info(_config(), 0)
    other = msgspec.structs.replace(rank_info(_config(block_size=16), 1), host="node-b")
    assert mismatch(first, first) is None
    line = mismatch(first, other)
    assert line.startswith("rank 1 on node-b has block_size=16, rank 0 on ")
    assert "has block_size=32: every node must load the same model" in line
    older = msgspec.structs.replace(first, rank=2, llmserve_version="0.0.9", torch_version="2.12.0")
    assert mismatch(first, older) == (
        f"rank 2 on {first.host} runs llmserve 0.0.9 with torch 2.12.0, rank 0 on {first.host} llmserve "
        f"{first.llmserve_version} with torch {torch.__version__}: every node needs the same"
    )


def _meet(tmp_path, infos: list[RankInfo], timeout: float = 10.0) -> tuple[object, list[object]]:
    """Rank 0 admits over a file store while each of `infos` joins from a thread: (rank 0's result or
    error, each joiner's result or error)."""
    tmp_path.mkdir()
    rendezvous = Rendezvous(f"file://{tmp_path}/store", timeout)
    store, _ = rendezvous.host_store()
    results: list[object] = [None] * len(infos)

    def run_join(index: int, info: RankInfo) -> None:
        try:
            results[index] = join(rendezvous.join_store(), info, timeout)
        except RendezvousError as error:
            results[index] = error

    threads = [threading.Thread(target=run_join, args=item) for item in enumerate(infos)]
    for thread in threads:
        thread.start()
    try:
        first = admit(
            store, rank_info(_config(tensor_parallel_size=len(infos) + 1), 0), len(infos) + 1, timeout
        )
    except RendezvousError as error:
        first = error
    for thread in threads:
        thread.join()
    return first, results


def test_the_rendezvous_admits_matching_ranks_and_tells_them_whether_they_share_a_host(tmp_path):
    config = _config(tensor_parallel_size=3)
    here = [rank_info(config, 1), rank_info(config, 2)]
    assert _meet(tmp_path / "a", here) == (True, [True, True])
    elsewhere = [here[0], msgspec.structs.replace(here[1], host_id="node-b/boot")]
    assert _meet(tmp_path / "b", elsewhere) == (False, [False, False])


def test_the_rendezvous_refuses_a_rank_with_another_block_size_on_every_rank(tmp_path):
    first, (joined,) = _meet(tmp_path / "a", [rank_info(_config(block_size=16), 1)])
    assert isinstance(first, RendezvousError) and isinstance(joined, RendezvousError)
    assert str(first) == str(joined)
    assert "rank 1 on" in str(first) and "has block_size=16, rank 0 on" in str(first)


def test_a_rank_that_never_comes_is_named_after_the_timeout(tmp_path):
    store, _ = Rendezvous(f"file://{tmp_path}/store", 0.3).host_store()
    with pytest.raises(
        RendezvousError, match="tensor-parallel ranks 1 did not reach the rendezvous within 0.3 s"
    ):
        admit(store, rank_info(_config(), 0), 2, 0.3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["serve", "--node-rank", "1", "--nnodes", "2"],
            "--node-rank 1 runs no engine (node 0 does): add --headless",
        ),
        (["serve", "--headless"], "--headless runs the ranks of a node other than 0"),
        (
            ["serve", "--data-parallel-size", "2", "--nnodes", "2"],
            "--nnodes spreads one engine's ranks over machines",
        ),
    ],
)
def test_serve_refuses_inconsistent_node_flags_in_one_line(argv, message, capsys):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
