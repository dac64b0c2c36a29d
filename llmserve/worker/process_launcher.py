"""Ranks as processes of this machine, started with multiprocessing (spawned) and watched by their
sentinels. Each exits with the process that started it (worker/parent_watch.py). After its start-up
result a rank sends its `RankStats` (metrics/ranks.py) up the same pipe, once a second at most."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
from multiprocessing.connection import wait

import msgspec

from llmserve.config import EngineConfig
from llmserve.distributed.rendezvous import Rendezvous
from llmserve.metrics.ranks import RankStats
from llmserve.worker.launcher import RankLauncher
from llmserve.worker.tp_worker import run_worker

logger = logging.getLogger("llmserve")

_REAP_SECONDS = 5.0


class ProcessRanks(RankLauncher):
    def __init__(self, config: EngineConfig, ranks: range, rendezvous: Rendezvous) -> None:
        self.ranks = ranks
        self.parallel = config.parallel
        context = multiprocessing.get_context("spawn")  # a fork would copy OpenMP's threads' state
        self.processes: list[multiprocessing.Process] = []
        self._ready = []  # each rank's pipe: its start-up result, then its RankStats
        self._reports: dict[int, RankStats] = {}
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
                return f"{self.parallel.rank_name(rank)} failed to load its shard: {message}"
        return None

    def exited(self) -> str | None:
        ready = wait(self.sentinels(), timeout=0)
        for rank, process in zip(self.ranks, self.processes, strict=True):
            if process.sentinel in ready:
                # its sentinel closes as it exits, a moment before it can be reaped: wait for the code
                process.join(_REAP_SECONDS)
                return _exit_line(self.parallel.rank_name(rank), process)
        return None

    def sentinels(self) -> list[int]:
        return [process.sentinel for process in self.processes]

    def reports(self) -> dict[int, RankStats]:
        for rank, pipe in zip(self.ranks, self._ready, strict=True):
            with contextlib.suppress(EOFError, OSError):
                while pipe.poll(0):
                    self._reports[rank] = pipe.recv()
        reports = {}
        for rank, process in zip(self.ranks, self.processes, strict=True):
            report = self._reports.get(rank) or RankStats(rank, process.pid or 0)
            if process.exitcode is not None:
                report = msgspec.structs.replace(report, exit_code=process.exitcode)
            reports[rank] = report
        return reports

    def wait_for_exit(self, timeout: float) -> str | None:
        # a peer's death reaches rank 0 as a reset connection, maybe before its exit is reaped
        wait([process.sentinel for process in self.processes], timeout=timeout)
        return self.exited()

    def wait_all(self) -> str | None:
        """Until every rank has exited, or one has failed: that one's line (a headless node's loop)."""
        running = dict(zip(self.ranks, self.processes, strict=True))
        while running:
            # the ranks' reports are read (and dropped: rank 0 serves the metrics) so no pipe fills up
            wait([process.sentinel for process in running.values()] + self._ready)
            self.reports()
            for rank, process in list(running.items()):
                if not process.is_alive():
                    del running[rank]
                    if process.exitcode != 0:
                        return _exit_line(self.parallel.rank_name(rank), process)
        return None

    def stop(self, grace_seconds: float) -> None:
        for process in self.processes:
            process.join(grace_seconds)
            if process.is_alive():
                process.kill()
                process.join()


def _exit_line(name: str, process: multiprocessing.Process) -> str:
    return f"{name} (pid {process.pid}) exited with code {process.exitcode}"
