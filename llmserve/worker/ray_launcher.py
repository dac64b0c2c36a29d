"""Ranks 1..N-1 as Ray actors, placed by a placement group on a Ray cluster (`ray start`).

The engine process stays rank 0 on its own node: bundle 0 of the placement group is pinned there
(by the `ray.io/node-id` label) and reserves rank 0's CPU (and on CUDA its GPU, which a `GpuClaim`
actor holds and names to rank 0); bundles 1..N-1 go wherever the cluster
has room, packed onto as few nodes as possible. Each actor loads its shard (`load`), then runs the
step loop until the empty plan (`serve`); the object ref of `serve` is how rank 0 watches it: it
resolves when the actor's process dies. Rank 0 reads each actor's latest `RankStats` with a `report`
call at most once a second, without waiting for the answer. The actors and the placement group
belong to this process (neither is detached), so Ray ends them when it ends; `stop` removes them
earlier.

Ray is imported here only, and this module only with `--distributed-executor-backend ray`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time

import torch

from llmserve.config import EngineConfig
from llmserve.distributed.rendezvous import Rendezvous
from llmserve.metrics.ranks import REPORT_INTERVAL_SECONDS, RankStats
from llmserve.worker.launcher import RankLauncher
from llmserve.worker.tp_worker import join_and_serve, load_shard, prepare_process, rank_groups, set_threads

logger = logging.getLogger("llmserve")

NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries its id under this label
_ADDRESS_PROBE_SECONDS = 10.0


def connect_ray(timeout_seconds: float) -> str:
    """Join the Ray cluster (RAY_ADDRESS, else the one started on this machine, else a new local
    one) unless this process already has; this node's address, where the ranks will meet."""
    try:
        import ray
    except ImportError:
        raise ValueError(
            "--distributed-executor-backend ray needs Ray, which is not installed: "
            "pip install 'llmserve[ray]' (on every node)"
        ) from None
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if address and address not in ("auto", "local"):
            _probe(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)
        except (ConnectionError, RuntimeError) as error:
            raise ValueError(f"cannot join the Ray cluster at {address or 'this machine'}: {error}") from None
    return ray.util.get_node_ip_address()


def _probe(address: str) -> None:
    """A one-line error within seconds when nothing answers at the cluster's address (Ray would retry
    for a minute and more)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=_ADDRESS_PROBE_SECONDS):
            return
    except (OSError, ValueError) as error:
        raise ValueError(
            f"the Ray cluster at RAY_ADDRESS={address} does not answer ({error}); start it with "
            "`ray start --head` or fix RAY_ADDRESS"
        ) from None


class LatestReport:
    """Where an actor's step loop leaves its `RankStats` (the `status` a process rank's pipe is)."""

    def __init__(self, rank: int) -> None:
        self.stats = RankStats(rank, os.getpid())

    def send(self, stats: RankStats) -> None:
        self.stats = stats


class RankActor:
    """One rank in a Ray actor's process (made a Ray actor class by `ray.remote` in RayRanks). The
    actor runs two calls at once (`max_concurrency=2`): `report` answers while `serve` steps."""

    def __init__(self, config: EngineConfig, rank: int, log_level: int) -> None:
        self.config = prepare_process(config, 0, log_level)  # Ray shows each actor only its own GPU
        self.rank = rank
        self.group, self.stage = rank_groups(config, rank)
        self.runner = None
        self.latest = LatestReport(rank)
        self._loaded = threading.Event()  # two calls run at once: `serve` waits for `load`

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def load(self) -> None:
        set_threads(self.config)  # calls run on the actor's pool threads: OpenMP's count is per thread
        try:
            self.runner = load_shard(self.config, self.group, self.stage)
        finally:
            self._loaded.set()

    def serve(self, rendezvous: Rendezvous) -> None:
        self._loaded.wait()
        if self.runner is None:
            raise RuntimeError("the shard failed to load")  # `load`'s own error is what rank 0 reports
        set_threads(self.config)
        join_and_serve(self.config, self.rank, self.runner, self.group, rendezvous, status=self.latest)

    def report(self) -> RankStats:
        return self.latest.stats


class GpuClaim:
    """Holds the GPU of bundle 0 for rank 0, which is this process and not an actor: Ray reserves a
    GPU per bundle, and only a task in the bundle learns which one, so without the claim rank 0
    could compute on a GPU Ray hands to an actor of the same node."""

    def gpu_id(self) -> str:
        import ray

        (gpu,) = ray.get_gpu_ids()
        return str(gpu)


def local_cuda_index(gpu_id: str, visible: str | None) -> int:
    """This process's CUDA index of the machine's GPU `gpu_id`, under its CUDA_VISIBLE_DEVICES."""
    if not visible:
        return int(gpu_id)
    ids = [part.strip() for part in visible.split(",")]
    if gpu_id not in ids:
        raise ValueError(
            f"Ray reserved GPU {gpu_id} for rank 0, which CUDA_VISIBLE_DEVICES={visible} hides from this "
            "process: unset it or include that GPU"
        )
    return ids.index(gpu_id)


class RayRanks(RankLauncher):
    def __init__(self, config: EngineConfig, rendezvous: Rendezvous) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        parallel = self.parallel = config.parallel
        self.ranks = range(1, parallel.world_size)
        self._ray = ray
        gpu = config.model.device.type == "cuda"
        bundle = {"CPU": 1.0, "GPU": 1.0} if gpu else {"CPU": 1.0}
        self.placement_group = _place(ray, bundle, parallel.world_size, parallel.collective_timeout_seconds)
        actor_class = ray.remote(RankActor)
        self.actors = [
            actor_class.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
                max_concurrency=2,  # `report` beside `serve`
            ).remote(config, rank, logger.getEffectiveLevel())
            for rank in self.ranks
        ]
        self._reports: dict[int, RankStats] = {}
        self._asked: dict[int, object] = {}  # rank -> the object ref of its `report` call in flight
        self._last_ask = -float("inf")
        self._claim = None
        if gpu:
            self._claim = (
                ray.remote(GpuClaim)
                .options(
                    num_cpus=0,
                    num_gpus=1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement_group, placement_group_bundle_index=0
                    ),
                )
                .remote()
            )
        # serve returns at shutdown; it waits for load, since the actor runs two calls at once
        self._node_ids = [actor.node_id.remote() for actor in self.actors]
        self._loaded = [actor.load.remote() for actor in self.actors]
        self._serving = [actor.serve.remote(rendezvous) for actor in self.actors]

    def rank0_device(self, device: torch.device) -> torch.device:
        if self._claim is None:
            return device
        gpu = self._ray.get(self._claim.gpu_id.remote())
        return torch.device("cuda", local_cuda_index(gpu, os.environ.get("CUDA_VISIBLE_DEVICES")))

    def node_ids(self) -> list[str]:
        """The Ray node of each actor, rank 1 first."""
        return self._ray.get(self._node_ids)

    def wait_loaded(self) -> str | None:
        for rank, loaded in zip(self.ranks, self._loaded, strict=True):
            try:
                self._ray.get(loaded)
            except Exception as error:  # noqa: BLE001 - RayTaskError wraps the actor's own exception
                return f"{self.parallel.rank_name(rank)} failed to load its shard: {_one_line(error)}"
        return None

    def exited(self) -> str | None:
        done, _ = self._ray.wait(self._serving, num_returns=len(self._serving), timeout=0)
        for rank, serving in zip(self.ranks, self._serving, strict=True):
            if serving in done:
                return self._exit_line(rank, serving)
        return None

    def wait_for_exit(self, timeout: float) -> str | None:
        self._ray.wait(self._serving, num_returns=1, timeout=timeout)
        return self.exited()

    def _exit_line(self, rank: int, serving) -> str:
        try:
            self._ray.get(serving)
        except Exception as error:  # noqa: BLE001 - RayActorError (died) or the step loop's own error
            return f"{self.parallel.rank_name(rank)} (Ray actor) exited: {_one_line(error)}"
        return f"{self.parallel.rank_name(rank)} (Ray actor) stopped"

    def reports(self) -> dict[int, RankStats]:
        """Without blocking: the answers of the `report` calls that came back, and at most once per
        report interval a new call to each actor that has none in flight."""
        if self._asked:
            done, _ = self._ray.wait(list(self._asked.values()), num_returns=len(self._asked), timeout=0)
            for rank, ref in list(self._asked.items()):
                if ref in done:
                    del self._asked[rank]
                    with contextlib.suppress(Exception):  # a dead actor: exited() names it
                        self._reports[rank] = self._ray.get(ref)
        now = time.monotonic()
        if now - self._last_ask >= REPORT_INTERVAL_SECONDS:
            self._last_ask = now
            for rank, actor in zip(self.ranks, self.actors, strict=True):
                if rank not in self._asked:
                    self._asked[rank] = actor.report.remote()
        return dict(self._reports)

    def stop(self, grace_seconds: float) -> None:
        if grace_seconds:
            self._ray.wait(self._serving, num_returns=len(self._serving), timeout=grace_seconds)
        for actor in self.actors + ([self._claim] if self._claim is not None else []):
            self._ray.kill(actor)
        self._ray.util.remove_placement_group(self.placement_group)


def _place(ray, bundle: dict[str, float], world_size: int, timeout_seconds: float):
    """A placement group of one bundle per rank, bundle 0 on this node for rank 0 (this process);
    a one-line ValueError when the cluster lacks the resources or cannot place them in time."""
    from ray.util.placement_group import placement_group, remove_placement_group

    need = {name: amount * world_size for name, amount in bundle.items()}
    have = ray.cluster_resources()
    if any(have.get(name, 0) < amount for name, amount in need.items()):
        raise ValueError(
            f"the Ray cluster has {_resources(have, need)}; tensor_parallel_size {world_size} needs "
            f"{_resources(need, need)} (one bundle of {_resources(bundle, bundle)} per rank): add nodes "
            "or lower --tensor-parallel-size"
        )
    here = ray.get_runtime_context().get_node_id()
    group = placement_group(
        [bundle] * world_size,
        strategy="PACK",
        bundle_label_selector=[{NODE_ID_LABEL: here}] + [{}] * (world_size - 1),
    )
    if not group.wait(timeout_seconds=timeout_seconds):
        remove_placement_group(group)
        raise ValueError(
            f"the Ray cluster could not place {world_size} bundles of {_resources(bundle, bundle)} (the "
            f"first on this node, for rank 0) within {timeout_seconds:g} s: free resources are "
            f"{_resources(ray.available_resources(), need)}"
        )
    return group


def _resources(resources: dict[str, float], names: dict[str, float]) -> str:
    return ", ".join(f"{resources.get(name, 0):g} {name}" for name in names)


def _one_line(error: BaseException) -> str:
    cause = getattr(error, "cause", None)  # RayTaskError: the exception the actor raised
    if isinstance(cause, BaseException):
        error = cause
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}"
