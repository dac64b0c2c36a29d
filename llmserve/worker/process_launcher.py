"""Ranks as processes of this machine, started with multiprocessing (spawned) and watched by their
sentinels. Each exits with the process that started it (worker/parent_watch.py)."""

from __future__ import annotations

import logging
import multiprocessing
from multiprocessing.connection import wait

from llmserve.config import EngineConfig
from llmserve.distributed.rendezvous import Rendezvous
from llmserve.worker.launcher import RankLauncher
from llmserve.worker.tp_worker import run_worker

logger = logging.getLogger("llmserve")


class ProcessRanks(RankLauncher):
    def __init__(self, config: EngineConfig, ranks: range, rendezvous: Rendezvous) -> None:
        self.ranks = ranks
        context = multiprocessing.get_context("spawn")  # a fork would copy OpenMP's threads' state
        self.processes: list[multiprocessing.Process] = []
        self._ready = []
        per_node = config.parallel.ranks_per_node
        for rank in ranks:
            receive, send = context.Pipe(duplex=False)
            process = context.Process(
                target=run_worker,
                args=(config, rank, rendezvous, send, logger.getEffectiveLevel(), rank % per_node),
                name=f"llmserve-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            send.close()
            self.processes.append(process)
            self._ready.append(receive)

    def wait_loaded(self) -> str | None:
        for rank, process, ready in zip(self.ranks, self.processes, self._ready, strict=True):
            wait([ready, process.sentinel])
            try:
                message = ready.recv()
            except EOFError:  # it exited before it could say why (its log has the traceback)
                process.join()
                message = f"it exited with code {process.exitcode}"
            if message is not None:
                return f"tensor-parallel rank {rank} failed to load its shard: {message}"
        return None

    def exited(self) -> str | None:
        for rank, process in zip(self.ranks, self.processes, strict=True):
            if not process.is_alive():
                return _exit_line(rank, process)
        return None

    def wait_for_exit(self, timeout: float) -> str | None:
        # a peer's death reaches rank 0 as a reset connection, maybe before its exit is reaped
        wait([process.sentinel for process in self.processes], timeout=timeout)
        return self.exited()

    def wait_all(self) -> str | None:
        """Until every rank has exited, or one has failed: that one's line (a headless node's loop)."""
        running = dict(zip(self.ranks, self.processes, strict=True))
        while running:
            wait([process.sentinel for process in running.values()])
            for rank, process in list(running.items()):
                if not process.is_alive():
                    del running[rank]
                    if process.exitcode != 0:
                        return _exit_line(rank, process)
        return None

    def stop(self, grace_seconds: float) -> None:
        for process in self.processes:
            process.join(grace_seconds)
            if process.is_alive():
                process.kill()
                process.join()


def _exit_line(rank: int, process: multiprocessing.Process) -> str:
    return f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
