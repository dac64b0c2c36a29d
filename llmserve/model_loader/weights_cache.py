"""On-disk cache of converted GGUF models, keyed by the file's SHA-256 and the loader format.

Converting a GGUF costs seconds at every start: parsing its metadata (the whole vocabulary),
dequantizing its tensors, building a fast tokenizer. The results are stored once, under
`$LLMSERVE_CACHE_DIR` (default ~/.cache/llmserve), and reloaded in milliseconds. Weights are kept in
float32 so that every serving dtype is derived from them exactly as from a fresh conversion.

Entries are written under a temporary name and renamed into place, so a crash or a concurrent start
never exposes a half-written entry. The cache only buys speed: a damaged entry is treated as a miss
and a cache that cannot be written is logged, never raised.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

LOADER_FORMAT = "v1"  # bump whenever the converted layout (names, shapes, q/k row order) changes
WEIGHTS_FILE = "weights.safetensors"
_HASH_CHUNK_BYTES = 8 << 20
_HASHES_DIR = "sha256"  # a source file's hash, by the hash of its path


def cache_root() -> Path:
    """The cache directory; `LLMSERVE_CACHE_DIR` overrides the per-user default."""
    root = os.environ.get("LLMSERVE_CACHE_DIR") or os.path.join("~", ".cache", "llmserve")
    return Path(root).expanduser()


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file; computed once for an unchanged file (its device, inode, size, mtime and
    ctime), then remembered in this process and in the cache (`_HASHES_DIR`): hashing the default
    model is a tenth of a second of every start."""
    stat = os.stat(path)
    return _sha256(
        os.path.realpath(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns
    )


@functools.lru_cache(maxsize=16)
def _sha256(path: str, *identity: int) -> str:
    remembered = cache_root() / _HASHES_DIR / f"{hashlib.sha256(path.encode()).hexdigest()}.json"
    try:
        known = json.loads(remembered.read_text())
        if known.get("identity") == list(identity) and known.get("path") == path:
            return known["sha256"]
    except (OSError, ValueError, AttributeError, KeyError):
        pass  # not remembered (or unreadable): hash it
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    text = json.dumps({"path": path, "identity": list(identity), "sha256": digest.hexdigest()})
    _write_file_atomically(remembered, lambda staging: Path(staging).write_text(text))
    return digest.hexdigest()


def entry_dir(source: str) -> Path:
    """The directory holding everything converted from `source`, in the current loader format."""
    return cache_root() / f"{file_sha256(source)}-{LOADER_FORMAT}"


def weights_file(source: str) -> Path:
    return entry_dir(source) / WEIGHTS_FILE


def load_weights(source: str, left_out: Collection[str] = ()) -> dict[str, torch.Tensor] | None:
    """The cached float32 state dict of `source`, less the tensors named in `left_out` (never read),
    or None on a miss (or a damaged entry)."""
    from safetensors import safe_open

    path = weights_file(source)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as entry:
            return {name: entry.get_tensor(name) for name in entry.keys() if name not in left_out}  # noqa: SIM118
    except Exception as error:  # a damaged entry is a miss: it is rewritten after the conversion
        logger.warning("ignoring the unreadable cache entry %s (%s)", path, error)
        return None


def cached_weight_names(source: str) -> frozenset[str]:
    """The names the cached float32 entry of `source` holds (its header only); empty on a miss."""
    from safetensors import safe_open

    path = weights_file(source)
    try:
        with safe_open(str(path), framework="pt") as entry:
            return frozenset(entry.keys())
    except Exception:  # noqa: BLE001 - a miss or a damaged entry: nothing cached
        return frozenset()


def save_weights(source: str, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path = weights_file(source)
    if _write_file_atomically(path, lambda staging: save_file(weights, staging)):
        logger.info("cached the converted weights of %s at %s", source, path)


def load_json(source: str, name: str) -> dict | None:
    path = entry_dir(source) / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        logger.warning("ignoring the unreadable cache entry %s (%s)", path, error)
        return None


def save_json(source: str, name: str, data: dict) -> None:
    text = json.dumps(data, indent=1, sort_keys=True)
    _write_file_atomically(entry_dir(source) / name, lambda staging: Path(staging).write_text(text))


def cached_dir(source: str, name: str) -> Path | None:
    """A cached directory entry (e.g. a saved tokenizer), or None on a miss."""
    path = entry_dir(source) / name
    return path if path.is_dir() else None


def save_dir(source: str, name: str, fill: Callable[[str], None]) -> None:
    """Publish the directory that `fill` writes into a staging path; the first publisher wins."""
    target = entry_dir(source) / name
    staging = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(dir=target.parent, prefix=f".{name}.")
        fill(staging)
        os.chmod(staging, 0o755)
        os.rename(staging, target)
    except Exception as error:
        if not target.is_dir():  # else another process published it first, which is as good
            logger.warning(
                "cannot write the cache entry %s (%s); the next start converts again", target, error
            )
    finally:
        if staging is not None and os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)


def discard_dir(source: str, name: str) -> None:
    """Remove a damaged directory entry so that a fresh conversion can take its place."""
    shutil.rmtree(entry_dir(source) / name, ignore_errors=True)


def _write_file_atomically(target: Path, write: Callable[[str], None]) -> bool:
    """Write via a staging file in the same directory and rename it over `target`."""
    staging = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        descriptor, staging = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(descriptor)
        write(staging)
        os.chmod(staging, 0o644)
        os.replace(staging, target)
        return True
    except Exception as error:  # a full disk or a read-only cache only costs the next start time
        logger.warning("cannot write the cache entry %s (%s); the next start converts again", target, error)
        return False
    finally:
        if staging is not None and os.path.exists(staging):
            os.unlink(staging)
