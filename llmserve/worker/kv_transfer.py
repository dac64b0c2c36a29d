"""Prefill/decode disaggregation, the model runner's side: the connector that sends a prefill
instance's exported blocks (core/kv_transfer.py) to where a decode instance finds them.

A connector has two halves. The sender (`KVConnector.send`) runs in the producer's model runner
after the forward that wrote the blocks, before the step's output leaves the engine. The receiving
end lands the blocks as disk-tier files (core/kv_block_file.py) in the decode instance's folder,
where its tiers' lookup finds them (core/kv_tiers.py) and loads them as disk hits; another transport
(the Ray object store, NCCL) would land them the same way.

`SharedFolderConnector` ("LlmserveConnector") is the single-machine / shared-filesystem connector: it
writes each block as a disk-tier file (core/kv_block_file.py: checked, written under a temporary name
and renamed) into the model's subfolder of `shared_dir`, the same subfolder a decode instance of the
same model uses as its disk tier.

`GlooConnector` ("LlmserveGlooConnector") sends them with torch.distributed send/recv over gloo to one
decode instance, whose `GlooReceiver` thread writes them as the same files into its own folder:

    prefill: seq = store.add; store.queue_push(seq)       decode (listens on kv_ip:kv_port, a TCPStore):
             a two-rank gloo group named by seq, rank 0    queue_pop -> the same group, rank 1
             send: meta, model key, hashes, tokens, K/V ->  recv, check the model key, write the files
             recv: acknowledgement <------------------------ send: 1 (0: refused, another model)

Each transfer has a group of its own, so a peer that died mid-transfer fails that transfer alone
(within `timeout_s`), and either side may restart. The prefill instance's step waits for the
acknowledgement, so the files exist before its answer reaches the router; after a failure it sends
nothing for `timeout_s` (a decode instance that is down costs one timeout, not one per step).
"""

from __future__ import annotations

import abc
import datetime
import logging
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from llmserve.config import EngineConfig
from llmserve.config.kv_transfer import GLOO
from llmserve.core import kv_block_file
from llmserve.core.kv_transfer import KVExport
from llmserve.worker.kv_tier_store import model_fingerprint

logger = logging.getLogger("llmserve")


class KVConnector(abc.ABC):
    """Sends a prefill instance's full prompt blocks to the decode instances."""

    @abc.abstractmethod
    def send(self, exports: list[KVExport]) -> None:
        """Send these blocks (their KV is in the pool now); a failure is logged, never raised: the
        decode instance then misses those blocks and computes them."""


class SharedFolderConnector(KVConnector):
    def __init__(self, config: EngineConfig, kv_blocks: torch.Tensor) -> None:
        """`kv_blocks`: the pool as [layers, 2, blocks, block_size, kv_heads, row]."""
        self.kv_blocks = kv_blocks
        self.model_key = model_fingerprint(config, _block_shape(kv_blocks), kv_blocks.dtype)
        self.directory = shared_folder(config.cache.kv_transfer.shared_dir, self.model_key)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.failed = False  # the first write that failed is logged; the later ones too, at debug
        logger.info("KV transfer: a prefill instance writing its prompts' blocks to %s", self.directory)

    @torch.inference_mode()
    def send(self, exports: list[KVExport]) -> None:
        for export in exports:
            path = kv_block_file.block_path(self.directory, export.block_hash)
            if path.exists():  # sent before (a shared prefix): the file is this block's, checked on read
                continue
            payload = (
                self.kv_blocks[:, :, export.block].contiguous().cpu().view(torch.uint8).numpy().tobytes()
            )
            try:
                kv_block_file.write_block(path, self.model_key, export.block_hash, export.tokens, payload)
            except OSError as error:
                (logger.debug if self.failed else logger.error)(
                    "KV transfer: cannot write %s (%s)", path, error
                )
                self.failed = True


def shared_folder(shared_dir: str, model_key: bytes) -> Path:
    """The model's subfolder of the shared folder, as the disk tier names it (worker/kv_tier_store.py)."""
    return Path(shared_dir) / model_key.hex()[:16]


_QUEUE, _SEQUENCE = "kv-transfers", "kv-transfer-seq"  # the TCPStore's keys
_STOP = b"stop"  # queued by `GlooReceiver.close`
_IDLE_WAIT = datetime.timedelta(hours=24)


class GlooConnector(KVConnector):
    def __init__(
        self, kv_blocks: torch.Tensor, model_key: bytes, address: tuple[str, int], timeout_s: float
    ) -> None:
        """`address`: the decode instance's (kv_ip, kv_port)."""
        self.kv_blocks = kv_blocks
        self.model_key = model_key
        self.address = address
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store: dist.TCPStore | None = None  # connected at the first transfer (the peer may start later)
        self.retry_at = 0.0  # after a failure, transfers are skipped until then
        logger.info(
            "KV transfer: a prefill instance sending its prompts' blocks to %s:%d over gloo", *self.address
        )

    def send(self, exports: list[KVExport]) -> None:
        if time.monotonic() < self.retry_at:
            return
        try:
            if self.store is None:
                self.store = dist.TCPStore(*self.address, is_master=False, timeout=self.timeout)
            if not _transfer_ack(self._group(), _encode(self.kv_blocks, self.model_key, exports)):
                logger.error(
                    "KV transfer: the decode instance refused the blocks (another model or KV format)"
                )
        except RuntimeError as error:  # torch.distributed's errors (DistError): timeouts, a peer gone
            self.store, self.retry_at = None, time.monotonic() + self.timeout.total_seconds()
            logger.warning(
                "KV transfer to %s:%d failed (%s); the decode instance computes those blocks",
                *self.address,
                str(error).splitlines()[0],
            )

    def _group(self) -> dist.ProcessGroupGloo:
        """A two-rank group of this transfer's own, rank 0 here; the decode instance joins as rank 1."""
        sequence = self.store.add(_SEQUENCE, 1)
        self.store.queue_push(_QUEUE, str(sequence))
        return dist.ProcessGroupGloo(
            dist.PrefixStore(f"kv-transfer-{sequence}", self.store), 0, 2, self.timeout
        )


class GlooReceiver(threading.Thread):
    """A decode instance's side of the gloo connector: each transfer's blocks written as files into its
    disk tier's folder, where a lookup finds them (core/kv_tiers.py)."""

    def __init__(self, directory: Path, model_key: bytes, address: tuple[str, int], timeout_s: float) -> None:
        """Listen on `address` (kv_ip, kv_port) and write what arrives into `directory` from now on."""
        super().__init__(name="kv-transfer-receiver", daemon=True)
        self.model_key = model_key
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(*address, is_master=True, wait_for_workers=False, timeout=self.timeout)
        # the queue is read through a connection of its own whose waits are long: each wait that ends
        # empty-handed logs a warning in torch, which a short timeout would repeat all day
        self.waiter = dist.TCPStore("127.0.0.1", self.store.port, is_master=False, timeout=_IDLE_WAIT)
        self.received = 0  # blocks written so far
        self.closing = False
        logger.info("KV transfer: a decode instance receiving blocks on port %d over gloo", address[1])
        self.start()

    def close(self) -> None:
        """Stop receiving and wait for the thread (the store's threads must not outlive the process's
        Python objects: the process would abort at exit)."""
        self.closing = True
        self.store.queue_push(_QUEUE, _STOP)
        self.join(timeout=2 * self.timeout.total_seconds())

    def run(self) -> None:
        while not self.closing:
            try:
                item = self.waiter.queue_pop(_QUEUE)
            except RuntimeError:
                continue  # nothing was sent meanwhile
            if item == _STOP:
                return
            sequence = int(item)
            try:
                self._receive(sequence)
            except RuntimeError as error:  # the prefill instance died or stalled mid-transfer
                logger.warning(
                    "KV transfer %d failed (%s); its blocks are computed here",
                    sequence,
                    str(error).splitlines()[0],
                )

    def _receive(self, sequence: int) -> None:
        store = dist.PrefixStore(f"kv-transfer-{sequence}", self.store)
        group = dist.ProcessGroupGloo(store, 1, 2, self.timeout)
        meta = _recv(group, torch.empty(3, dtype=torch.int64))
        count, block_size, block_bytes = meta.tolist()
        model_key = _recv(group, torch.empty(32, dtype=torch.uint8)).numpy().tobytes()
        hashes = _recv(group, torch.empty(count, 32, dtype=torch.uint8)).numpy()
        tokens = _recv(group, torch.empty(count, block_size, dtype=torch.int64)).tolist()
        payloads = _recv(group, torch.empty(count, block_bytes, dtype=torch.uint8)).numpy()
        accepted = model_key == self.model_key
        if accepted:
            for block_hash, block_tokens, payload in zip(hashes, tokens, payloads, strict=True):
                block_hash = block_hash.tobytes()
                path = kv_block_file.block_path(self.directory, block_hash)
                kv_block_file.write_block(
                    path, self.model_key, block_hash, tuple(block_tokens), payload.tobytes()
                )
            self.received += count
        else:
            logger.error("KV transfer %d: blocks of another model or KV format; ignored", sequence)
        group.send([torch.tensor([int(accepted)])], 0, 0).wait()


def _encode(kv_blocks: torch.Tensor, model_key: bytes, exports: list[KVExport]) -> list[torch.Tensor]:
    """One transfer's tensors: (count, block size, bytes per block), the model key, hashes, tokens, K/V."""
    blocks = kv_blocks[:, :, [export.block for export in exports]].movedim(2, 0).contiguous().cpu()
    payloads = blocks.view(torch.uint8).reshape(len(exports), -1)
    return [
        torch.tensor([len(exports), len(exports[0].tokens), payloads.shape[1]], dtype=torch.int64),
        torch.frombuffer(bytearray(model_key), dtype=torch.uint8),
        torch.frombuffer(bytearray(b"".join(e.block_hash for e in exports)), dtype=torch.uint8).view(-1, 32),
        torch.tensor([list(export.tokens) for export in exports], dtype=torch.int64),
        payloads,
    ]


def _transfer_ack(group: dist.ProcessGroupGloo, tensors: list[torch.Tensor]) -> bool:
    """Send the tensors in order; whether the decode instance accepted them."""
    for tensor in tensors:
        group.send([tensor], 1, 0).wait()
    return bool(_recv(group, torch.zeros(1, dtype=torch.int64), source=1).item())


def _recv(group: dist.ProcessGroupGloo, tensor: torch.Tensor, source: int = 0) -> torch.Tensor:
    group.recv([tensor], source, 0).wait()
    return tensor


def _block_shape(kv_blocks: torch.Tensor) -> tuple[int, ...]:
    return (*kv_blocks.shape[:2], *kv_blocks.shape[3:])


def create_connector(config: EngineConfig, kv_blocks: torch.Tensor) -> KVConnector | None:
    """A prefill instance's connector (--kv-transfer-config with kv_producer or kv_both); None otherwise."""
    transfer = config.cache.kv_transfer
    if transfer is None or not transfer.produces:
        return None
    if transfer.kv_connector == GLOO:
        model_key = model_fingerprint(config, _block_shape(kv_blocks), kv_blocks.dtype)
        return GlooConnector(kv_blocks, model_key, (transfer.kv_ip, transfer.kv_port), transfer.timeout_s)
    return SharedFolderConnector(config, kv_blocks)


def create_receiver(config: EngineConfig, kv_blocks: torch.Tensor) -> GlooReceiver | None:
    """A decode instance's gloo receiver, listening from now on; None for other instances and connectors,
    and for a profiling runner (no tiers: its pool is not the one serving)."""
    cache = config.cache
    transfer = cache.kv_transfer
    if (
        transfer is None
        or not transfer.consumes
        or transfer.kv_connector != GLOO
        or cache.kv_offloading is None
    ):
        return None
    model_key = model_fingerprint(config, _block_shape(kv_blocks), kv_blocks.dtype)
    address = (transfer.kv_ip, transfer.kv_port)
    return GlooReceiver(shared_folder(transfer.shared_dir, model_key), model_key, address, transfer.timeout_s)
