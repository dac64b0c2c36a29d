"""How the ranks other than rank 0 are started and watched: the contract of each backend.

`ProcessRanks` (worker/process_launcher.py) runs them as processes of this machine: the engine's
workers with `--distributed-executor-backend mp`, or a headless node's share of them with
`--nnodes`. `RayRanks` (worker/ray_launcher.py) runs them as Ray actors placed on a Ray cluster.
The executor (worker/executor.py) talks to either through these methods only; every failure comes
back as one line naming the rank, which the executor raises as a TensorParallelError.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from llmserve.metrics.ranks import RankStats


class RankLauncher(ABC):
    ranks: range  # the global ranks this launcher started

    @abstractmethod
    def wait_loaded(self) -> str | None:
        """Block until every rank has loaded its shard; the first failure as one line, else None."""

    @abstractmethod
    def exited(self) -> str | None:
        """Without blocking: the first rank known to have exited, as one line; None while all run."""

    @abstractmethod
    def wait_for_exit(self, timeout: float) -> str | None:
        """`exited()`, after waiting at most `timeout` seconds for some rank to exit."""

    @abstractmethod
    def stop(self, grace_seconds: float) -> None:
        """Give the ranks `grace_seconds` to exit on their own (after the empty plan), then kill them."""

    def rank0_device(self, device: torch.device) -> torch.device:
        """The device rank 0 (the engine's process) computes on, where the backend assigns it."""
        return device

    def sentinels(self) -> list[int]:
        """Handles that become ready as a rank exits, for an idle engine to wait on (none: it polls)."""
        return []

    def reports(self) -> dict[int, RankStats]:
        """The latest `RankStats` each rank sent, by rank (none where the ranks send none)."""
        return {}
