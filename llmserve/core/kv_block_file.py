"""The disk tier's file format: one file per KV block, named by its chained hash, checked on every read.

    offset 0   magic b"LLMSKV01"
           8   fingerprint (32 bytes: model, dtype, KV format, block size, pool shape; `fingerprint`)
           40  block hash (32 bytes: the prefix cache's chained SHA-256, so it covers the whole prefix)
           72  number of tokens (u32), CRC-32 of tokens + payload (u32), payload bytes (u64)
           88  the block's token ids (int64 each), then the payload (the block's K/V bytes as the pool
               stores them: [layers, 2, block_size, kv_heads, row] of one block)

A file is loaded only if its magic, fingerprint, hash, tokens, length and checksum all match: a file of
another model, a truncated write or a flipped bit reads as a miss (the block is recomputed), never as
KV. Files are written to a temporary name and renamed, so a crash mid-write leaves no file under a
block's name; the temporary name is the writing process's own (host, pid, a random part), so that
servers sharing the folder neither write into nor delete each other's writes in progress. No
tensors here: the payload is bytes; the model runner (worker/kv_tier_store.py) turns blocks into
bytes and back.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import struct
import time
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"LLMSKV01"
_HEADER = struct.Struct("<8s32s32sIIQ")
SUFFIX = ".kvb"


_TEMPORARY_MAX_AGE = 60.0  # seconds; a write takes far less, so an older temporary file is a dead write's
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]  # a pid means something on its host


def fingerprint(**parts: object) -> bytes:
    """SHA-256 over everything that changes a block's KV bytes (sorted by name, as JSON)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).digest()


def block_path(directory: Path, block_hash: bytes) -> Path:
    return directory / f"{block_hash.hex()}{SUFFIX}"


def file_size(num_tokens: int, payload_bytes: int) -> int:
    """Bytes a block's file takes."""
    return _HEADER.size + 8 * num_tokens + payload_bytes


@dataclass(frozen=True)
class BlockFileHeader:
    block_hash: bytes
    tokens: tuple[int, ...]
    payload_bytes: int
    checksum: int


def write_block(path: Path, model_key: bytes, block_hash: bytes, tokens: tuple[int, ...], payload) -> None:
    """Write the block's file atomically (a temporary name, then a rename); raises OSError."""
    token_bytes = array("q", tokens).tobytes()
    checksum = zlib.crc32(payload, zlib.crc32(token_bytes))
    header = _HEADER.pack(MAGIC, model_key, block_hash, len(tokens), checksum, len(payload))
    temporary = temporary_path(path)
    try:
        with open(temporary, "wb") as file:
            file.write(header)
            file.write(token_bytes)
            file.write(payload)
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)
        raise


def temporary_path(path: Path) -> Path:
    """A name for a write of `path` in progress that no other write shares (host, pid, random part)."""
    return path.with_name(f"{path.name}.{_HOST}-{os.getpid()}-{secrets.token_hex(4)}.tmp")


def remove_dead_temporaries(directory: Path, max_age: float = _TEMPORARY_MAX_AGE) -> None:
    """Delete the temporary files of writes a crash interrupted: those of a process of this host that
    is gone, and any older than `max_age` seconds; a live process's write in progress stays."""
    now = time.time()
    for path in directory.glob(f"*{SUFFIX}.*tmp"):
        try:
            age = now - path.stat().st_mtime
        except OSError:
            continue
        if age > max_age or _writer_gone(path.name):
            path.unlink(missing_ok=True)


def _writer_gone(name: str) -> bool:
    """Whether the temporary file's writer is a process of this host that no longer runs."""
    writer = name.removesuffix(".tmp").rsplit(".", 1)[-1].split("-")
    if len(writer) != 3 or writer[0] != _HOST or not writer[1].isdigit():
        return False  # another host's, or an older name: only its age tells
    pid = int(writer[1])
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return True
    except OSError:  # exists, another user's
        return False
    return False


def read_header(path: Path, model_key: bytes) -> BlockFileHeader | None:
    """The file's header and tokens if it is ours (magic, fingerprint) and as long as it says; else None."""
    try:
        with open(path, "rb") as file:
            head = file.read(_HEADER.size)
            if len(head) < _HEADER.size:
                return None
            magic, found_key, block_hash, num_tokens, checksum, payload_bytes = _HEADER.unpack(head)
            if magic != MAGIC or found_key != model_key:
                return None
            token_bytes = file.read(8 * num_tokens)
            size = os.fstat(file.fileno()).st_size
    except OSError:
        return None
    if len(token_bytes) != 8 * num_tokens or size != file_size(num_tokens, payload_bytes):
        return None
    return BlockFileHeader(block_hash, tuple(array("q", token_bytes)), payload_bytes, checksum)


def read_block(path: Path, model_key: bytes, block_hash: bytes, tokens: tuple[int, ...]) -> bytes | None:
    """The block's payload if the file is whole and holds exactly this block of this model; else None."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _HEADER.size:
        return None
    magic, found_key, found_hash, num_tokens, checksum, payload_bytes = _HEADER.unpack_from(data)
    if (magic, found_key, found_hash) != (MAGIC, model_key, block_hash) or num_tokens != len(tokens):
        return None
    if len(data) != file_size(num_tokens, payload_bytes):
        return None
    body = memoryview(data)[_HEADER.size :]
    if zlib.crc32(body) != checksum or tuple(array("q", bytes(body[: 8 * num_tokens]))) != tokens:
        return None
    return bytes(body[8 * num_tokens :])


def scan(directory: Path, model_key: bytes) -> Iterator[tuple[BlockFileHeader, int]]:
    """Our blocks' headers in the directory with their file sizes, least recently written first; files
    that are not ours, or whose name is not their hash, are skipped (left alone)."""
    entries = []
    for path in directory.glob(f"*{SUFFIX}"):
        try:
            stat = path.stat()
        except OSError:
            continue
        entries.append((stat.st_mtime_ns, path.name, path, stat.st_size))
    for _, _, path, size in sorted(entries):
        header = read_header(path, model_key)
        if header is not None and path == block_path(directory, header.block_hash):
            yield header, size
