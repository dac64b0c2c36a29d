"""`llmserve serve --data-parallel-size N`: N engine replicas behind one router on --port.

Each replica is a whole `llmserve serve` (server process and engine process) on a private loopback
port, pinned to its own share of this process's CPUs (whole physical cores where there are enough)
with its own KV pool, and publishing its KV events on private loopback ZMQ ports. This process binds
--port first, starts the replicas, waits until each answers, then runs the router there until
SIGTERM or Ctrl-C, and stops every replica on the way out. Each replica also asks the kernel to
SIGTERM it if this process dies, so none is ever orphaned. With `--distributed-executor-backend ray`
the replicas are Ray actors' servers on the cluster's nodes instead (router/ray_replicas.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from llmserve.config import EngineArgs
from llmserve.config.flags import changed_flags
from llmserve.config.router import RouterConfig
from llmserve.config.server import API_KEY_ENV, ServerConfig
from llmserve.entrypoints.openai.serve import bound_socket
from llmserve.router.app import load_router_tokenizer, run_router

logger = logging.getLogger("llmserve.router")

STARTUP_TIMEOUT_SECONDS = 900.0  # a replica loading a large model on a busy machine
STOP_TIMEOUT_SECONDS = 20.0
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


def split_cpus(cpus: list[int], size: int) -> list[list[int]]:
    """`size` disjoint CPU sets, as even as they can be, whole cores kept together where there are
    at least `size` cores; with fewer CPUs than replicas, replicas share CPUs (with a warning)."""
    if size > len(cpus):
        logger.warning("%d replicas on %d CPUs: replicas share CPUs", size, len(cpus))
        return [[cpus[i % len(cpus)]] for i in range(size)]
    cores = _group_by_core(cpus)
    units = cores if len(cores) >= size else [[cpu] for cpu in cpus]
    share, extra = divmod(len(units), size)
    sets, start = [], 0
    for replica in range(size):
        end = start + share + (replica < extra)
        sets.append(sorted(cpu for unit in units[start:end] for cpu in unit))
        start = end
    return sets


def _group_by_core(cpus: list[int]) -> list[list[int]]:
    """The CPUs grouped by physical core (SMT siblings together), in order of their first CPU."""
    cores: dict[object, list[int]] = {}
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topology / "physical_package_id").read_text(), (topology / "core_id").read_text())
        except OSError:
            key = cpu  # topology unknown: every CPU its own core
        cores.setdefault(key, []).append(cpu)
    return list(cores.values())


@dataclasses.dataclass
class ReplicaProcess:
    rank: int
    url: str
    cpus: list[int]
    process: subprocess.Popen

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the replica drains and stops its engine

    def wait_stopped(self) -> None:
        try:
            self.process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def serve_data_parallel(config: ServerConfig, engine_args: EngineArgs) -> int:
    if engine_args.kv_events_config is not None:
        raise ValueError("--data-parallel-size sets each replica's --kv-events-config itself; drop the flag")
    if engine_args.distributed_executor_backend == "ray":
        return _serve_on_ray(config, engine_args)
    cpu_sets = split_cpus(sorted(os.sched_getaffinity(0)), config.data_parallel_size)
    with bound_socket(config.host, config.port) as sock:
        replicas: list[ReplicaProcess] = []
        try:
            for rank, cpus in enumerate(cpu_sets):
                replicas.append(_start_replica(rank, cpus, config, engine_args))
            urls = tuple(r.url for r in replicas)
            router = _router_config(config, engine_args, urls)
            tokenizer = load_router_tokenizer(router)  # while the replicas load their models
            _wait_until_ready([(r.rank, r.url, r.process.poll) for r in replicas])
            run_router(router, sock, config.host, tokenizer)
        finally:
            for replica in replicas:
                replica.terminate()
            for replica in replicas:
                replica.wait_stopped()
    return 0


def _router_config(config: ServerConfig, engine_args: EngineArgs, urls: tuple[str, ...]) -> RouterConfig:
    return RouterConfig.create(urls, config.routing, engine_args.model, 30.0, config.api_key)


def _serve_on_ray(config: ServerConfig, engine_args: EngineArgs) -> int:
    """The replicas as Ray actors on the cluster (router/ray_replicas.py), the router here."""
    from llmserve.router.ray_replicas import RayReplicas

    # the key travels in the environment, not on the command line, where `ps` shows it
    env = {API_KEY_ENV: config.api_key} if config.api_key else {}
    # a node's CPUs are shared by whatever Ray places there: no pinning to all of them
    flags = [*_replica_flags(config, engine_args), "--no-cpu-binding"]
    ranks = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    timeout = engine_args.distributed_timeout_seconds
    with bound_socket(config.host, config.port) as sock:
        replicas = RayReplicas(config.data_parallel_size, ranks, flags, env, timeout)
        try:
            urls = replicas.start()
            router = _router_config(config, engine_args, urls)
            tokenizer = load_router_tokenizer(router)
            polls = [lambda rank=rank: replicas.exit_code(rank) for rank in range(len(urls))]
            _wait_until_ready(list(zip(range(len(urls)), urls, polls, strict=True)))
            run_router(router, sock, config.host, tokenizer)
        finally:
            replicas.stop()
    return 0


def _start_replica(
    rank: int, cpus: list[int], config: ServerConfig, engine_args: EngineArgs
) -> ReplicaProcess:
    port, events_port, replay_port = _free_ports(3)
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{events_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    # the console script's set-up (tcmalloc, the OpenMP spin), as a single server gets
    command = [sys.executable, "-m", "llmserve.cli.launch", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port)]
    command += ["--kv-events-config", json.dumps(events), *_replica_flags(config, engine_args)]
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus))}
    if config.api_key:
        env[API_KEY_ENV] = config.api_key  # not on the command line, where `ps` shows it
    libc = ctypes.CDLL("libc.so.6", use_errno=True)  # loaded here: the child only calls it
    process = subprocess.Popen(command, env=env, preexec_fn=lambda: _pin_and_tie_to_parent(cpus, libc))
    logger.info("replica %d: pid %d on CPUs %s, http://127.0.0.1:%d", rank, process.pid, cpus, port)
    return ReplicaProcess(rank, f"http://127.0.0.1:{port}", cpus, process)


def _replica_flags(config: ServerConfig, engine_args: EngineArgs) -> list[str]:
    """The user's server and engine flags that differ from their defaults, for each replica."""
    return [*config.replica_flags(), *changed_flags(engine_args, frozenset({"kv_events_config"}))]


def _pin_and_tie_to_parent(cpus: list[int], libc: ctypes.CDLL) -> None:
    """In the child before exec: its CPUs, and SIGTERM when the parent dies."""
    os.sched_setaffinity(0, cpus)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_ports(count: int) -> list[int]:
    """Loopback ports free now (held open together so they differ)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def _wait_until_ready(replicas: list[tuple[int, str, Callable[[], int | None]]]) -> None:
    """Until every replica (rank, URL, its exit code or None) answers /health; ValueError as soon as one
    exits or after the timeout."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
    pending = list(replicas)
    while pending:
        for replica in list(pending):
            rank, url, poll = replica
            code = poll()
            if code is not None:
                raise ValueError(f"replica {rank} exited with code {code} while starting (see above)")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    pending.remove(replica)
        if time.monotonic() > deadline:
            raise ValueError(
                f"replicas {[rank for rank, _, _ in pending]} not ready after {STARTUP_TIMEOUT_SECONDS} s"
            )
        time.sleep(0.2)
