"""On-disk cache of converted models, keyed by the source file's SHA-256.

Converting a GGUF (dequantizing its tensors, building a fast tokenizer from its vocabulary) costs
seconds; the second start loads the converted form instead. Entries are written to a temporary
name and renamed, so a crash or a concurrent start never leaves a half-written entry.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

FORMAT_VERSION = "1"  # bump when the converted layout changes


def cache_dir() -> Path:
    root = os.environ.get("LLMSERVE_CACHE_DIR") or os.path.join(Path.home(), ".cache", "llmserve")
    return Path(root)


def file_digest(path: str) -> str:
    stat = os.stat(path)
    return _digest(path, stat.st_size, stat.st_mtime_ns)


@functools.cache
def _digest(path: str, size: int, mtime_ns: int, chunk_size: int = 8 << 20) -> str:
    """SHA-256 of the file, computed once per (path, size, mtime) in this process."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def entry_path(source: str, kind: str) -> Path:
    """Where the converted `kind` ("weights", "tokenizer") of `source` lives."""
    return cache_dir() / f"{file_digest(source)[:32]}-v{FORMAT_VERSION}" / kind
