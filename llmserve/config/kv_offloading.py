"""KVOffloadingConfig: the RAM and disk tiers under the prefix cache (core/kv_tiers.py, docs/kv_cache.md).

vLLM's flags for the RAM tier: `--kv-offloading-size` (GiB) and `--kv-offloading-backend native`; vLLM has
no disk flag of its own (LMCache names its disk tier `local_disk` and `max_local_disk_size`), so the disk
tier's are llmserve's: `--kv-offloading-disk-dir` and `--kv-offloading-disk-size` (GiB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

KVOffloadingBackend = Literal["native"]  # vLLM's native offloading (lmcache: not here)
BACKENDS = get_args(KVOffloadingBackend)
_GIB = 1 << 30


@dataclass(frozen=True)
class KVOffloadingConfig:
    ram_bytes: int  # host memory of the RAM tier
    disk_dir: str | None = None  # the disk tier's folder (one subfolder per model fingerprint); None: none
    disk_bytes: int = 0  # the disk tier's size

    def __post_init__(self) -> None:
        if self.ram_bytes < 1:
            raise ValueError("--kv-offloading-size must hold at least one block")
        if (self.disk_dir is None) != (self.disk_bytes == 0):
            raise ValueError("--kv-offloading-disk-dir and --kv-offloading-disk-size go together")

    @classmethod
    def create(
        cls, size_gib: float | None, backend: str | None, disk_dir: str | None, disk_size_gib: float | None
    ) -> KVOffloadingConfig | None:
        """The flags' config; None where offloading is off. ValueError (one line) for bad values."""
        if size_gib is None:
            if backend is not None or disk_dir is not None or disk_size_gib is not None:
                raise ValueError("--kv-offloading-backend and the disk flags need --kv-offloading-size")
            return None
        if backend not in (None, *BACKENDS):
            raise ValueError(f"--kv-offloading-backend must be one of {BACKENDS}, got {backend!r}")
        _check_gib("--kv-offloading-size", size_gib)
        if disk_size_gib is not None:
            _check_gib("--kv-offloading-disk-size", disk_size_gib)
        if (disk_dir is None) != (disk_size_gib is None):
            raise ValueError("--kv-offloading-disk-dir and --kv-offloading-disk-size go together")
        if disk_dir is not None and not disk_dir.strip():
            raise ValueError("--kv-offloading-disk-dir must name a folder")
        disk_bytes = max(1, int(disk_size_gib * _GIB)) if disk_size_gib is not None else 0
        return cls(max(1, int(size_gib * _GIB)), disk_dir, disk_bytes)


def _check_gib(flag: str, value: float) -> None:
    if not (isinstance(value, int | float) and 0 < value < math.inf):
        raise ValueError(f"{flag} must be a positive number of GiB, got {value!r}")
