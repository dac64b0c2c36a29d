"""Where the ranks meet, and the check every rank passes there before the first collective.

Rank 0 hosts a torch.distributed key-value store: a file store when every rank is a process of
this machine, a TCP store on `host:port` when ranks run elsewhere (mp over several nodes, Ray).
Each other rank writes its `RankInfo` (host, pid, llmserve and torch versions, the engine settings
that must agree) under its rank; rank 0 reads them all, compares each with its own and writes one
`Verdict`: no error admits every rank, else the one-line error, which every rank raises. Only then
do they join the process group, so a mismatch between nodes is a line naming both sides rather
than a gloo error or wrong tokens.

The store also carries exit notes: the process that started a rank on another node (a headless
node) reports that rank's exit there, so that rank 0 can name the rank whose death broke a step.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

import llmserve
from llmserve.config import EngineConfig

_VERDICT_KEY = "llmserve/verdict"
_READ_KEY = "llmserve/verdict_read"  # how many ranks have read the verdict
_REFUSAL_READ_SECONDS = 5.0


class RendezvousError(RuntimeError):
    pass


class RankInfo(msgspec.Struct, frozen=True):
    rank: int
    host: str
    host_id: str  # hostname and boot id: ranks with the same one share this machine's memory
    pid: int
    llmserve_version: str
    torch_version: str
    settings: dict[str, str]  # what must equal rank 0's: the model, its dtype, the KV pool's shape


class Verdict(msgspec.Struct, frozen=True):
    error: str | None
    same_host: bool  # every rank on rank 0's machine


def rank_info(config: EngineConfig, rank: int) -> RankInfo:
    """This process's entry for the rendezvous, as rank `rank`."""
    return RankInfo(
        rank=rank,
        host=socket.gethostname(),
        host_id=_host_id(),
        pid=os.getpid(),
        llmserve_version=llmserve.__version__,
        torch_version=str(torch.__version__),
        settings=_settings(config),
    )


def _settings(config: EngineConfig) -> dict[str, str]:
    model, cache = config.model, config.cache
    return {
        "tensor_parallel_size": str(config.parallel.tensor_parallel_size),
        "model": repr(model.arch),
        "dtype": str(model.dtype),
        "device": model.device.type,
        "max_model_len": str(model.max_model_len),
        "block_size": str(cache.block_size),
        "num_blocks": str(cache.num_blocks),
        "kv_cache_dtype": cache.kv_cache_dtype,
        "sliding_window": f"{cache.sliding_window}+{cache.attention_sinks}",
        "deterministic": str(model.deterministic),  # every rank's kernels alike (unset: decided alike)
    }


def _host_id() -> str:
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as boot:
        return f"{socket.gethostname()}/{boot.read().strip()}"
    return socket.gethostname()


def mismatch(first: RankInfo, other: RankInfo) -> str | None:
    """One line naming both ranks and what differs between them; None if they agree."""
    mine = f"rank {first.rank} on {first.host}"
    theirs = f"rank {other.rank} on {other.host}"
    if (other.llmserve_version, other.torch_version) != (first.llmserve_version, first.torch_version):
        return (
            f"{theirs} runs llmserve {other.llmserve_version} with torch {other.torch_version}, {mine} "
            f"llmserve {first.llmserve_version} with torch {first.torch_version}: every node needs the same"
        )
    for key, value in first.settings.items():
        if other.settings.get(key) != value:
            return (
                f"{theirs} has {key}={other.settings.get(key)}, {mine} has {key}={value}: every node must "
                "load the same model with the same engine flags"
            )
    return None


@dataclass(frozen=True)
class Rendezvous:
    """How a rank reaches rank 0's store (picklable: it travels to each worker)."""

    address: str  # "file:///path/store" or "tcp://host:port"
    timeout_seconds: float

    @classmethod
    def tcp(cls, host: str, port: int, timeout_seconds: float) -> Rendezvous:
        return cls(f"tcp://{host}:{port}", timeout_seconds)

    def host_store(self) -> tuple[dist.Store, Rendezvous]:
        """Rank 0: the store, and this rendezvous with the port it took (port 0: a free one)."""
        timeout = timedelta(seconds=self.timeout_seconds)
        if self.address.startswith("file://"):
            return dist.FileStore(self.address.removeprefix("file://"), -1), self
        host, port = self._host_port()
        try:
            store = dist.TCPStore(host, port, None, True, timeout=timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as error:
            raise RendezvousError(f"cannot listen for the rendezvous on port {port}: {error}") from None
        return store, Rendezvous.tcp(host, store.port, self.timeout_seconds)

    def join_store(self) -> dist.Store:
        """A rank other than 0: rank 0's store, waiting for it to listen at most the timeout."""
        timeout = timedelta(seconds=self.timeout_seconds)
        if self.address.startswith("file://"):
            return dist.FileStore(self.address.removeprefix("file://"), -1)
        host, port = self._host_port()
        wait_for_listener(host, port, self.timeout_seconds)
        return dist.TCPStore(host, port, None, False, timeout=timeout)

    def _host_port(self) -> tuple[str, int]:
        host, _, port = self.address.removeprefix("tcp://").rpartition(":")
        return host, int(port)


def wait_for_listener(host: str, port: int, timeout_seconds: float) -> None:
    """Until something accepts connections on host:port; a one-line RendezvousError after the timeout
    (torch's own store client would log a stack trace per attempt)."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, timeout_seconds)):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"node 0's rendezvous at {host}:{port} did not answer within {timeout_seconds:g} s "
                    f"({error}): is the engine started there, with the same --master-addr/--master-port?"
                ) from None
        time.sleep(0.2)


def join(store: dist.Store, info: RankInfo, timeout_seconds: float) -> bool:
    """A rank other than 0: report `info`, wait for rank 0's verdict; whether all share one host."""
    store.set(f"llmserve/rank/{info.rank}", msgspec.msgpack.encode(info))
    try:
        store.wait([_VERDICT_KEY], timedelta(seconds=timeout_seconds))
        verdict = msgspec.msgpack.decode(store.get(_VERDICT_KEY), type=Verdict)
        store.add(_READ_KEY, 1)
    except RuntimeError as error:  # torch's store errors (a timeout, a reset connection) are these
        raise RendezvousError(f"rank {info.rank}: no verdict from rank 0's rendezvous: {error}") from None
    if verdict.error is not None:
        raise RendezvousError(verdict.error)
    return verdict.same_host


def admit(store: dist.Store, first: RankInfo, world_size: int, timeout_seconds: float) -> bool:
    """Rank 0: every rank's info within the timeout, checked against `first`; the verdict written for
    them all. RendezvousError (the verdict's error) if one is missing or differs."""
    keys = [f"llmserve/rank/{rank}" for rank in range(1, world_size)]
    deadline = time.monotonic() + timeout_seconds
    while missing := [rank for rank, key in enumerate(keys, start=1) if not store.check([key])]:
        if time.monotonic() >= deadline:
            error = (
                f"tensor-parallel ranks {', '.join(map(str, missing))} did not reach the rendezvous within "
                f"{timeout_seconds:g} s (start other nodes with the same --master-addr and --master-port)"
            )
            return _refuse(store, error, world_size - 1 - len(missing))
        time.sleep(0.05)
    infos = [msgspec.msgpack.decode(store.get(key), type=RankInfo) for key in keys]
    for info in infos:
        if (error := mismatch(first, info)) is not None:
            return _refuse(store, error, len(infos))
    same_host = all(info.host_id == first.host_id for info in infos)
    store.set(_VERDICT_KEY, msgspec.msgpack.encode(Verdict(None, same_host)))
    return same_host


def _refuse(store: dist.Store, error: str, readers: int) -> bool:
    """Write the error as the verdict, and keep the store up until its `readers` have read it (a few
    seconds at most): the caller shuts it down next."""
    store.set(_VERDICT_KEY, msgspec.msgpack.encode(Verdict(error, False)))
    deadline = time.monotonic() + _REFUSAL_READ_SECONDS
    while store.add(_READ_KEY, 0) < readers and time.monotonic() < deadline:
        time.sleep(0.05)
    raise RendezvousError(error)


def note_exit(store: dist.Store, rank: int, message: str) -> None:
    """Report on rank 0's store that `rank` exited (a headless node's agent, for its ranks)."""
    store.set(f"llmserve/exited/{rank}", message.encode())


def exit_note(store: dist.Store, ranks: range) -> str | None:
    """The first exit note among `ranks`, if any was written (never blocks)."""
    for rank in ranks:
        key = f"llmserve/exited/{rank}"
        if store.check([key]):
            return store.get(key).decode()
    return None
