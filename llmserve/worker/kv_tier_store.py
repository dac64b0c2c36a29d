"""The model runner's side of the KV tiers (core/kv_tiers.py): the RAM tier's tensor, the disk tier's
files, and the copies the step plan orders between them and the device pool.

The RAM tier is one CPU tensor of `ram_blocks` blocks shaped as the pool's blocks (allocated pinned on
CUDA). Its copies are not DMA from that pinned memory: the indexed reads make ordinary temporaries (a
save gathers the pool's blocks on the device and copies them to pageable host memory, a load gathers
the RAM slots into a pageable tensor and copies that to the device). The disk tier is one folder per
model fingerprint under `--kv-offloading-disk-dir`, one file per block (core/kv_block_file.py). Ops
run in their order; runs of saves or of loads are batched into one indexed copy (ops of one kind
never touch each other's blocks).

A file that cannot be written (disk full, permissions) is logged once and the disk tier stops
writing; the engine hands the blocks whose files were not written to the scheduler's side after the
step (`take_unwritten`), which drops them from its index and admits no more blocks to the disk.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from pathlib import Path

import torch

from llmserve.config import EngineConfig
from llmserve.core import kv_block_file
from llmserve.core.kv_tiers import TierOp, TierSpec

logger = logging.getLogger("llmserve")


def model_fingerprint(config: EngineConfig, block_shape: tuple[int, ...], dtype: torch.dtype) -> bytes:
    """Everything that changes a block's K/V bytes: the model (its path, its files' sizes and times,
    its architecture, quantization and dtype), the KV format, the block's shape, and whether prompt
    spans took the batch-invariant attention (--deterministic, as the model runner resolved it), whose
    K/V bits differ from the prefill kernel's from the second layer on."""
    model, cache = config.model, config.cache
    path = os.path.realpath(model.path)
    files = [path] if os.path.isfile(path) else sorted(str(p) for p in Path(path).iterdir() if p.is_file())
    stats = [(os.path.basename(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    return kv_block_file.fingerprint(
        format=2,
        path=path,
        files=stats,
        arch=dataclasses.asdict(model.arch),
        quantization=repr(model.quantization),
        dtype=str(model.dtype),
        kv_cache_dtype=cache.kv_cache_dtype,
        block_size=cache.block_size,
        block_shape=list(block_shape),
        storage=str(dtype),
        deterministic=bool(config.model.deterministic),
    )


class KVTierStore:
    def __init__(self, config: EngineConfig, kv_blocks: torch.Tensor) -> None:
        """`kv_blocks`: the pool as [layers, 2, blocks, block_size, kv_heads, row]."""
        offloading = config.cache.kv_offloading
        self.kv_blocks = kv_blocks
        self.device = kv_blocks.device
        self.block_shape = (*kv_blocks.shape[:2], *kv_blocks.shape[3:])
        block_bytes = kv_blocks[:, :, 0].numel() * kv_blocks.element_size()
        model_key = model_fingerprint(config, self.block_shape, kv_blocks.dtype)
        disk_dir = None
        if offloading.disk_dir is not None:
            disk_dir = Path(offloading.disk_dir) / model_key.hex()[:16]
        self.spec = TierSpec(
            ram_blocks=offloading.ram_bytes // block_bytes,
            disk_dir=disk_dir,
            disk_blocks=offloading.disk_bytes
            // kv_block_file.file_size(config.cache.block_size, block_bytes),
            model_key=model_key,
            block_bytes=block_bytes,
            shared=config.cache.kv_transfer is not None and config.cache.kv_transfer.consumes,
        )
        if not self.spec.ram_blocks or (disk_dir is not None and not self.spec.disk_blocks):
            raise ValueError(f"--kv-offloading-size and -disk-size must hold a block ({block_bytes} bytes)")
        self.ram = torch.empty(
            *kv_blocks.shape[:2],
            self.spec.ram_blocks,
            *kv_blocks.shape[3:],
            dtype=kv_blocks.dtype,
            device="cpu",
            pin_memory=self.device.type == "cuda",
        )
        self.disk_writable = disk_dir is not None
        self._unwritten: list[bytes] = []  # blocks whose demote wrote no file, not yet taken
        where = f", disk {self.spec.disk_blocks} blocks in {disk_dir}" if disk_dir is not None else ""
        logger.info("KV tiers: RAM %d blocks of %d bytes%s", self.spec.ram_blocks, block_bytes, where)
        self._ram_load_seconds: list[float] = []  # each step's RAM-to-device copies

    def take_ram_load_seconds(self) -> tuple[float, ...]:
        """The RAM tier's load times since the last call (the engine's step stats take them)."""
        seconds = tuple(self._ram_load_seconds)
        self._ram_load_seconds.clear()
        return seconds

    def take_unwritten(self) -> list[bytes]:
        """The block hashes whose files were not written since the last call (none until a write fails)."""
        unwritten, self._unwritten = self._unwritten, []
        return unwritten

    @torch.inference_mode()
    def apply(self, ops: list[TierOp]) -> None:
        """Run the plan's tier ops in order."""
        start, loaded = time.monotonic(), False
        for kind, run in itertools.groupby(ops, key=lambda op: op.kind):
            run = list(run)
            if kind == "save":
                self.ram[:, :, [op.slot for op in run]] = self.kv_blocks[:, :, [op.block for op in run]].cpu()
            elif kind == "load":
                slots, loaded = [op.slot for op in run], True
                self.kv_blocks[:, :, [op.block for op in run]] = self.ram[:, :, slots].to(self.device)
            elif kind == "load_bytes":
                for op in run:
                    self.kv_blocks[:, :, op.block] = self._from_bytes(op.payload).to(self.device)
            else:
                for op in run:
                    (self._write if kind == "demote" else self._delete)(op)
        if loaded:  # the whole op list: a copy to the device may wait for the saves before it
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._ram_load_seconds.append(time.monotonic() - start)

    def _from_bytes(self, payload: bytes) -> torch.Tensor:
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return raw.view(self.kv_blocks.dtype).view(self.block_shape)

    def _write(self, op: TierOp) -> None:
        """One RAM slot to its file; the first failure is logged and ends the disk tier's writes."""
        if not self.disk_writable:
            self._unwritten.append(op.block_hash)
            return
        block = self.ram[:, :, op.slot].contiguous()
        payload = block.view(torch.uint8).numpy().tobytes()
        path = kv_block_file.block_path(self.spec.disk_dir, op.block_hash)
        try:
            kv_block_file.write_block(path, self.spec.model_key, op.block_hash, op.tokens, payload)
        except OSError as error:
            self.disk_writable = False
            self._unwritten.append(op.block_hash)
            logger.error("KV disk tier: cannot write %s (%s); no more blocks go to disk", path, error)

    def _delete(self, op: TierOp) -> None:
        try:
            kv_block_file.block_path(self.spec.disk_dir, op.block_hash).unlink(missing_ok=True)
        except OSError as error:
            logger.debug("KV disk tier: cannot delete block %s: %s", op.block_hash.hex(), error)
