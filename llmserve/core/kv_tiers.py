"""Tiers under the prefix cache: blocks evicted from the device pool go to host RAM, then to local disk.

The scheduler's side, no tensors: which block hashes each tier holds, in LRU order, and the copies the
model runner makes (worker/kv_tier_store.py), in the order they were decided:

    device pool --evicted--> RAM tier --LRU out--> disk tier --LRU out--> gone
         ^                      |                      |
         '------ a prefix hit loads a block back ------'

    save (device block -> RAM slot)     demote (RAM slot -> file)     delete (file)
    load (RAM slot -> device block)     load_bytes (a file's verified bytes -> device block)

Both tiers are inclusive: a block loaded back keeps its RAM copy and its file, so evicting it again
costs nothing; a RAM entry leaves for the disk only if the disk lacks it. Ops run before the step's
forward, in order: each reads the state the ops before it left, so a save reads a block before a load
overwrites it, and a demote reads a slot before a save reuses it. Entries a hit is loading from are
pinned while its blocks are allocated (an allocation evicts, and an eviction takes a RAM slot).

Disk reads run in the background: a request whose hit has blocks on disk starts their reads (a thread
reads and verifies each file, core/kv_block_file.py) and waits in the queue while the steps go on
without it; once every read is done it is admitted and its loads run before its first step like any
copy. A failed read drops the entry and refuses that admission; the next lookup finds the shorter hit.
Copies between RAM and the device are not overlapped with the forward (they run before it).

KV events: a block that moves to a tier stays in the set of hashes the engine can hit, so its eviction
from the device is not reported; `BlockRemoved` (medium of the tier it left last) comes when no tier
and not the pool holds it any more. A block loaded back was never reported removed: no `BlockStored`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from llmserve.core import kv_block_file
from llmserve.core.kv_events import MEDIUM_CPU, BlockRemoved

if TYPE_CHECKING:
    from llmserve.core.block_pool import BlockPool

logger = logging.getLogger("llmserve")

TIER_BLOCK = -2  # a prefix-hit entry whose KV waits in a tier: it gets a fresh block and a load
_MAX_IDLE_READS = 4096  # reads done but never loaded (their request went away) kept at most
MEDIUM_DISK = "DISK"
TierName = Literal["ram", "disk"]
Key = tuple[bytes, tuple[int, ...]]  # (block hash, its tokens)


class TierOp(msgspec.Struct, array_like=True, gc=False):
    """One copy for the model runner; the fields its kind does not use keep their defaults."""

    kind: Literal["save", "demote", "load", "load_bytes", "delete"]
    block: int = -1  # device block
    slot: int = -1  # RAM slot
    block_hash: bytes = b""  # demote, delete: the file's block
    tokens: tuple[int, ...] = ()  # demote: the block's tokens (the file's header keeps them)
    payload: bytes = b""  # load_bytes: a file's verified K/V bytes


@dataclass(frozen=True)
class TierSpec:
    """The tiers' sizes and the disk tier's identity, resolved from the pool's shape by the runner."""

    ram_blocks: int  # blocks the RAM tier holds
    disk_dir: Path | None  # this model's folder of block files; None: no disk tier
    disk_blocks: int  # block files the disk tier keeps
    model_key: bytes  # kv_block_file.fingerprint of everything that changes a block's bytes
    block_bytes: int  # K/V bytes of one block (a file's payload)
    disk_read_threads: int = 1  # threads reading files in the background; 0: read at once, in the caller
    # a decode instance (core/kv_transfer.py): a prefill instance writes files into the disk folder too,
    # so a lookup the index misses checks for a file that arrived since
    shared: bool = False


@dataclass
class TierCounters:
    """Running totals of one tier (metrics read what they grew by)."""

    hits: int = 0  # blocks a prefix hit found here (not in the device pool)
    bytes_loaded: int = 0  # K/V bytes copied from here into the device pool
    bytes_stored: int = 0  # K/V bytes copied here
    load_seconds: list[float] = field(default_factory=list)  # disk: each file's read and check

    def take_load_seconds(self) -> tuple[float, ...]:
        """The load times since the last call."""
        seconds, self.load_seconds = self.load_seconds, []  # a reader thread appends to the list
        return tuple(seconds)


class _InlineExecutor(Executor):
    """Runs each read at once, in the caller (disk_read_threads = 0)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


class _LRU:
    """Hashes in least-recently-used order with their tokens and a value; pinned ones are never evicted."""

    def __init__(self) -> None:
        self.entries: OrderedDict[bytes, tuple[tuple[int, ...], int]] = OrderedDict()
        self.pinned: set[bytes] = set()

    def get(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        """The entry's value if it holds these tokens (a hash collision never hits)."""
        entry = self.entries.get(block_hash)
        return entry[1] if entry is not None and entry[0] == tokens else None

    def touch(self, block_hash: bytes) -> None:
        self.entries.move_to_end(block_hash)

    def victim(self) -> bytes | None:
        """The least recently used hash that is not pinned."""
        return next((h for h in self.entries if h not in self.pinned), None)


def _without_overwritten_saves(ops: list[TierOp]) -> list[TierOp]:
    """The ops less each save whose RAM slot a later save overwrites before any op reads it (an entry
    saved and evicted within one step): a wasted copy, and one indexed copy writing a slot twice."""
    overwritten, unread = set(), {}  # unread: slot -> index of its latest save no op has read since
    for index, op in enumerate(ops):
        if op.kind == "save":
            if op.slot in unread:
                overwritten.add(unread[op.slot])
            unread[op.slot] = index
        elif op.kind in ("load", "demote"):
            unread.pop(op.slot, None)
    return [op for index, op in enumerate(ops) if index not in overwritten] if overwritten else ops


class KVTiers:
    def __init__(self, spec: TierSpec, pool: BlockPool) -> None:
        self.spec = spec
        self.pool = pool  # the device pool whose evictions come here (its events, its cache index)
        self.ram = _LRU()  # value: the RAM slot
        self.free_slots = list(reversed(range(spec.ram_blocks)))
        self.disk = _LRU()  # value: unused (0)
        self.ops: list[TierOp] = []
        self.counters: dict[TierName, TierCounters] = {"ram": TierCounters(), "disk": TierCounters()}
        self._unflushed: set[bytes] = set()  # files whose write is an op not yet run
        self._reads: dict[bytes, Future[bytes | None]] = {}  # disk blocks being read, or read, not loaded
        self._wanted: set[bytes] = set()  # disk blocks a waiting hit asked for since the last take_ops
        self._reader: Executor | None = None
        self.disk_writable = True  # False once the model runner reports a file it could not write
        if spec.disk_dir is not None:
            self._rebuild_disk_index(spec.disk_dir)
            threads = spec.disk_read_threads
            self._reader = (
                ThreadPoolExecutor(threads, thread_name_prefix="kv-disk-read")
                if threads
                else _InlineExecutor()
            )

    def _rebuild_disk_index(self, directory: Path) -> None:
        """Index the folder's files of this model (a restart gets hits at once), oldest first; files
        past the disk tier's size are deleted, oldest first, and so are half-written ones of dead writers
        (another server on the folder may be writing its own)."""
        directory.mkdir(parents=True, exist_ok=True)
        kv_block_file.remove_dead_temporaries(directory)
        for header, _ in kv_block_file.scan(directory, self.spec.model_key):
            if header.payload_bytes == self.spec.block_bytes:
                self.disk.entries[header.block_hash] = (header.tokens, 0)
        while len(self.disk.entries) > self.spec.disk_blocks:
            block_hash, _ = self.disk.entries.popitem(last=False)
            kv_block_file.block_path(directory, block_hash).unlink(missing_ok=True)
        if self.disk.entries:
            logger.info("KV disk tier: %d blocks found in %s", len(self.disk.entries), directory)

    # -- lookups ------------------------------------------------------------------------------------

    def find(self, block_hash: bytes, tokens: tuple[int, ...]) -> bool:
        """Whether a tier holds the block (an index lookup, no I/O; `fetch` reads and verifies)."""
        if self.ram.get(block_hash, tokens) is not None:
            return True
        if block_hash in self._unflushed:
            return False
        if self.disk.get(block_hash, tokens) is not None:
            return True
        return self.spec.shared and self._arrived(block_hash, tokens)

    def _arrived(self, block_hash: bytes, tokens: tuple[int, ...]) -> bool:
        """Whether a prefill instance has written this block's file into the shared folder (its header
        read and checked); such a block joins the disk tier's index as its most recent entry."""
        if block_hash in self.disk.entries:  # indexed with other tokens: a hash collision never hits
            return False
        path = kv_block_file.block_path(self.spec.disk_dir, block_hash)
        header = kv_block_file.read_header(path, self.spec.model_key)
        if header is None or (header.block_hash, header.tokens) != (block_hash, tokens):
            return False
        if header.payload_bytes != self.spec.block_bytes or not self._disk_room():
            return False
        self.disk.entries[block_hash] = (tokens, 0)
        return True

    def ready(self, keys: list[Key]) -> bool:
        """Whether the hit's blocks on disk have been read; reads not started yet start now, in the
        background (the request waits, the steps go on)."""
        done = True
        for block_hash, tokens in keys:
            if self._reader is None or self.ram.get(block_hash, tokens) is not None:
                continue
            self._wanted.add(block_hash)
            future = self._reads.get(block_hash)
            if future is None:
                future = self._reader.submit(self._read_file, block_hash, tokens)
                self._reads[block_hash] = future
            done = done and future.done()
        return done

    def fetch(self, keys: list[Key]) -> list[int | bytes] | None:
        """Each block's source: its RAM slot, or its file's verified bytes (read now if `ready` did
        not start it); None (and the entries that failed dropped, so the next lookup stops before
        them) if any is gone or its file is bad."""
        sources: list[int | bytes] = []
        for block_hash, tokens in keys:
            slot = self.ram.get(block_hash, tokens)
            source = slot if slot is not None else self._take_read(block_hash, tokens)
            if source is None:
                return None
            sources.append(source)
        return sources

    def _take_read(self, block_hash: bytes, tokens: tuple[int, ...]) -> bytes | None:
        """A disk block's bytes as its read found them; a failed read drops the block from the tier."""
        directory = self.spec.disk_dir
        future = self._reads.pop(block_hash, None)
        if directory is None or self.disk.get(block_hash, tokens) is None or block_hash in self._unflushed:
            return None
        payload = future.result() if future is not None else self._read_file(block_hash, tokens)
        if payload is None:
            # a missing file is a write that failed (logged then); a bad one is news
            path = kv_block_file.block_path(directory, block_hash)
            log = logger.warning if path.exists() else logger.debug
            log("KV disk tier: the file of block %s is missing or corrupt; recomputing it", block_hash.hex())
            del self.disk.entries[block_hash]
            self.ops.append(TierOp("delete", block_hash=block_hash))
            self._gone(block_hash, MEDIUM_DISK)
        return payload

    def _read_file(self, block_hash: bytes, tokens: tuple[int, ...]) -> bytes | None:
        """The file's K/V bytes if it is whole and this block's (a reader thread runs this: it touches
        nothing but the file and its counter's list)."""
        start = time.monotonic()
        path = kv_block_file.block_path(self.spec.disk_dir, block_hash)
        payload = kv_block_file.read_block(path, self.spec.model_key, block_hash, tokens)
        self.counters["disk"].load_seconds.append(time.monotonic() - start)
        if payload is None or len(payload) != self.spec.block_bytes:
            return None
        with contextlib.suppress(OSError):  # a hit is a use: a restart's index keeps the LRU order
            os.utime(path)
        return payload

    @contextlib.contextmanager
    def pinned(self, keys: list[Key]) -> Iterator[None]:
        """Keep these entries while a hit's blocks are allocated (the allocation's evictions take RAM)."""
        hashes = {block_hash for block_hash, _ in keys}
        self.ram.pinned |= hashes
        try:
            yield
        finally:
            self.ram.pinned -= hashes

    def load(self, keys: list[Key], sources: list[int | bytes], blocks: list[int]) -> None:
        """Queue the copies of a fetched hit into its fresh device blocks; the entries become most recent."""
        for (block_hash, _), source, block in zip(keys, sources, blocks, strict=True):
            if isinstance(source, int):
                self.ram.touch(block_hash)
                self.ops.append(TierOp("load", block=block, slot=source))
                tier: TierName = "ram"
            else:
                if block_hash in self.disk.entries:  # the allocation's demotions may have pushed it out
                    self.disk.touch(block_hash)
                self.ops.append(TierOp("load_bytes", block=block, payload=source))
                tier = "disk"
            self.counters[tier].hits += 1
            self.counters[tier].bytes_loaded += self.spec.block_bytes

    # -- evictions ----------------------------------------------------------------------------------

    def offer(self, block: int, block_hash: bytes, tokens: tuple[int, ...]) -> bool:
        """The device pool evicts `block`: keep its KV in RAM (a save op); whether a tier holds it now."""
        if self.ram.get(block_hash, tokens) is not None:
            self.ram.touch(block_hash)
            return True
        slot = self._free_slot()
        if slot is None:  # no RAM tier, or every entry pinned by the hit being loaded
            return self.disk.get(block_hash, tokens) is not None
        self.ram.entries[block_hash] = (tokens, slot)
        self.ops.append(TierOp("save", block=block, slot=slot))
        self.counters["ram"].bytes_stored += self.spec.block_bytes
        return True

    def _free_slot(self) -> int | None:
        """A RAM slot: a free one, else the least recent entry's, moved to the disk if it lacks it."""
        if self.free_slots:
            return self.free_slots.pop()
        victim = self.ram.victim()
        if victim is None:
            return None
        tokens, slot = self.ram.entries.pop(victim)
        if self.disk_writable and self.disk.get(victim, tokens) is None and self._disk_room():
            self.disk.entries[victim] = (tokens, 0)
            self._unflushed.add(victim)
            self.ops.append(TierOp("demote", slot=slot, block_hash=victim, tokens=tokens))
            self.counters["disk"].bytes_stored += self.spec.block_bytes
        elif victim not in self.disk.entries:
            self._gone(victim, MEDIUM_CPU)
        return slot

    def _disk_room(self) -> bool:
        """Whether the disk tier can take one more file (its least recent one deleted if it is full)."""
        if self.spec.disk_dir is None or not self.spec.disk_blocks:
            return False
        if len(self.disk.entries) >= self.spec.disk_blocks:
            block_hash, _ = self.disk.entries.popitem(last=False)
            self._unflushed.discard(block_hash)
            self._reads.pop(block_hash, None)  # of the deleted file: a later file of the block is read anew
            self.ops.append(TierOp("delete", block_hash=block_hash))
            if block_hash not in self.ram.entries:
                self._gone(block_hash, MEDIUM_DISK)
        return True

    def writes_failed(self, unwritten: list[bytes]) -> None:
        """The model runner could not write these blocks' files (it writes no more): drop their entries
        and demote nothing more, so that no good file is evicted to make room for a missing one."""
        self.disk_writable = False
        for block_hash in unwritten:
            self._reads.pop(block_hash, None)
            if self.disk.entries.pop(block_hash, None) is not None and block_hash not in self.ram.entries:
                self._gone(block_hash, MEDIUM_DISK)

    def _gone(self, block_hash: bytes, medium: str) -> None:
        """Report a block no tier holds any more, unless the device pool still does."""
        if self.pool.events is not None and not self.pool.holds(block_hash):
            self.pool.events.append(BlockRemoved([block_hash], medium=medium))

    # -- the step -----------------------------------------------------------------------------------

    def take_ops(self) -> list[TierOp]:
        """The copies decided since the last call, in order (the step plan carries them)."""
        ops = _without_overwritten_saves(self.ops)
        self.counters["ram"].bytes_stored -= (len(self.ops) - len(ops)) * self.spec.block_bytes
        self.ops = []
        self._unflushed.clear()
        if len(self._reads) > _MAX_IDLE_READS:  # reads of requests that went away before loading them
            # a read a waiting hit still wants is kept: dropping it would start it again, never ready
            wanted = self._wanted
            self._reads = {h: f for h, f in self._reads.items() if h in wanted or not f.done()}
        self._wanted = set()
        return ops

    def reset(self) -> None:
        """Forget the RAM tier's blocks (the warm-up's, say); the disk tier outlives resets as restarts."""
        self.free_slots = list(reversed(range(self.spec.ram_blocks)))
        self.ram.entries.clear()

    def check_integrity(self) -> None:
        """Raise AssertionError unless every RAM slot is free or held by exactly one entry."""
        slots = [slot for _, slot in self.ram.entries.values()] + self.free_slots
        assert sorted(slots) == list(range(self.spec.ram_blocks)), "RAM tier slots are lost or shared"
        assert len(self.disk.entries) <= self.spec.disk_blocks, "disk tier over its size"
