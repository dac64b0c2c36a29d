"""`llmserve serve --headless` on node R > 0 of `--nnodes N`: this machine's share of the ranks, no engine.

It starts ranks R*k .. R*k+k-1 (k = world_size / nnodes) as processes, which load their shards and
join node 0's rendezvous at --master-addr:--master-port, then waits for them. A rank that exits
with an error is reported on node 0's store (rank 0 names it in its error) and its siblings here
are stopped; once the engine shuts down and the ranks exit cleanly, so does this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from llmserve.config import EngineArgs, EngineConfig
from llmserve.distributed.rendezvous import Rendezvous, note_exit
from llmserve.model_loader import load_arch_config, resolve_model_path
from llmserve.worker.process_launcher import ProcessRanks

logger = logging.getLogger("llmserve")

_NOTE_TIMEOUT_SECONDS = 5.0  # reporting an exit to node 0, which may be gone already


def serve_headless(args: EngineArgs) -> int:
    """The headless node's entry: the config from its own flags (node 0 checks them against its)."""
    if args.distributed_executor_backend != "mp":
        raise ValueError("--headless is for --distributed-executor-backend mp; Ray starts its actors itself")
    path = resolve_model_path(args.model)
    return run_headless(args.create_config(load_arch_config(path), path))


def run_headless(config: EngineConfig) -> int:
    """Run this node's ranks until they exit; 0 when all exit cleanly, else a ValueError naming one."""
    parallel = config.parallel
    if parallel.nnodes < 2 or parallel.node_rank == 0:
        raise ValueError(
            "--headless runs the ranks of a node other than 0: give --nnodes and --node-rank >= 1"
        )
    rendezvous = Rendezvous.tcp(
        parallel.master_addr, parallel.master_port, parallel.collective_timeout_seconds
    )
    ranks = ProcessRanks(config, parallel.node_ranks, rendezvous)
    try:
        failure = ranks.wait_loaded()
        if failure is None:
            logger.info(
                "node %d: ranks %d-%d loaded; joining node 0 at %s:%d",
                parallel.node_rank,
                ranks.ranks[0],
                ranks.ranks[-1],
                parallel.master_addr,
                parallel.master_port,
            )
            failure = ranks.wait_all()
        if failure is not None:
            _report(rendezvous, ranks.ranks, failure)
            raise ValueError(failure)
    finally:
        ranks.stop(0)
    logger.info("node %d: every rank exited cleanly", parallel.node_rank)
    return 0


def _report(rendezvous: Rendezvous, ranks: range, failure: str) -> None:
    """Leave the failure on node 0's store, under each of this node's ranks; best effort."""
    quick = dataclasses.replace(rendezvous, timeout_seconds=_NOTE_TIMEOUT_SECONDS)
    with contextlib.suppress(Exception):
        store = quick.join_store()
        for rank in ranks:
            note_exit(store, rank, failure)
