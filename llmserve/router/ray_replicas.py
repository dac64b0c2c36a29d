"""`llmserve serve --data-parallel-size N --distributed-executor-backend ray`: the N replicas placed on a
Ray cluster, behind the router this process runs.

A placement group holds one bundle per replica (as many CPUs as the replica's engine has ranks),
spread over the cluster's nodes where they have room. In each bundle a `ReplicaServer` actor starts a
whole `llmserve serve` on its node, on ports free there and bound to the node's address, publishing
its KV events on that address too, so the router on this node reaches both; the server process is
tied to the actor's (it gets SIGTERM when the actor dies). A replica is the same `llmserve serve` as a
local one: the router cannot tell them apart, and a replica's own tensor-parallel ranks, if any, are
placed on the cluster by its engine.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys

logger = logging.getLogger("llmserve.router")

STOP_TIMEOUT_SECONDS = 20.0
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


class ReplicaServer:
    """One replica's `llmserve serve` process on the actor's node (a Ray actor class by `ray.remote`)."""

    def __init__(self, rank: int, flags: list[str], env: dict[str, str]) -> None:
        self.rank, self.flags, self.env = rank, flags, env
        self.process: subprocess.Popen | None = None

    def start(self) -> tuple[str, str]:
        """Start the server; (its URL, this node's Ray id)."""
        import ray

        host = ray.util.get_node_ip_address()
        port, events_port, replay_port = _free_ports(host, 3)
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{host}:{events_port}",
            "replay_endpoint": f"tcp://{host}:{replay_port}",
        }
        command = [sys.executable, "-m", "llmserve.cli.launch", "serve", "--host", host, "--port", str(port)]
        command += ["--kv-events-config", json.dumps(events), *self.flags]
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        # Ray set OMP_NUM_THREADS to the actor's CPUs; the server inherits it
        self.process = subprocess.Popen(
            command,
            env={**os.environ, **self.env},
            preexec_fn=lambda: libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM),
        )
        return f"http://{host}:{port}", ray.get_runtime_context().get_node_id()

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # the replica drains and stops its engine
        try:
            self.process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class RayReplicas:
    """The replicas' actors and their placement group; `urls` once `start` has returned."""

    def __init__(
        self, size: int, cpus_per_replica: int, flags: list[str], env: dict[str, str], timeout_seconds: float
    ) -> None:
        from llmserve.worker.ray_launcher import connect_ray

        connect_ray(timeout_seconds)
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        bundle = {"CPU": float(cpus_per_replica)}
        have = ray.cluster_resources().get("CPU", 0)
        if have < size * cpus_per_replica:
            raise ValueError(
                f"the Ray cluster has {have:g} CPU; --data-parallel-size {size} needs "
                f"{size * cpus_per_replica} CPU ({cpus_per_replica} per replica, one per engine rank): "
                "add nodes or lower --data-parallel-size"
            )
        self.placement_group = placement_group([bundle] * size, strategy="SPREAD")
        if not self.placement_group.wait(timeout_seconds=timeout_seconds):
            remove_placement_group(self.placement_group)
            raise ValueError(
                f"the Ray cluster could not place {size} replicas of {cpus_per_replica} CPU within "
                f"{timeout_seconds:g} s"
            )
        actor_class = ray.remote(ReplicaServer)
        self.actors = [
            actor_class.options(
                num_cpus=cpus_per_replica,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote(rank, flags, env)
            for rank in range(size)
        ]
        self.urls: tuple[str, ...] = ()
        self.node_ids: tuple[str, ...] = ()

    def start(self) -> tuple[str, ...]:
        started = self._ray.get([actor.start.remote() for actor in self.actors])
        self.urls = tuple(url for url, _ in started)
        self.node_ids = tuple(node for _, node in started)
        for rank, (url, node) in enumerate(started):
            logger.info("replica %d: %s, a Ray actor on node %s", rank, url, node)
        return self.urls

    def exit_code(self, rank: int) -> int | None:
        """The exit code of replica `rank`'s server; None while it runs."""
        return self._ray.get(self.actors[rank].poll.remote())

    def stop(self) -> None:
        """Stop every replica's server, then give the cluster back its resources."""
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):  # an actor that died has nothing left to stop
            self._ray.get([actor.stop.remote() for actor in self.actors], timeout=2 * STOP_TIMEOUT_SECONDS)
        for actor in self.actors:
            self._ray.kill(actor)
        remove_placement_group(self.placement_group)


def _free_ports(host: str, count: int) -> list[int]:
    """Ports free now on `host` (held open together so they differ)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
