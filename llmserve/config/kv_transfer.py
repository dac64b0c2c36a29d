"""KVTransferConfig: an engine started as a prefill or decode instance (vLLM's --kv-transfer-config).

vLLM's keys, given as one JSON object: `kv_connector` (which connector moves the blocks), `kv_role`
(`kv_producer`: a prefill instance that exports its prompts' full KV blocks; `kv_consumer`: a decode
instance that finds them as prefix-cache hits; `kv_both`: both) and `kv_connector_extra_config` (the
connector's own settings). The one connector, `LlmserveConnector`, moves blocks through a folder both
instances can read (the disk tier's file format, core/kv_block_file.py): single machine or a shared
filesystem. Its extra config: `shared_dir` (the folder) and `shared_size_gib` (how much of it a decode
instance's disk tier keeps, LRU). docs/data_parallel.md says what is not done.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal, get_args

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
ROLES = get_args(KVRole)
CONNECTORS = ("LlmserveConnector",)  # the shared-folder connector (worker/kv_transfer.py)
_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config")
_EXTRA_KEYS = ("shared_dir", "shared_size_gib")
_DEFAULT_SHARED_GIB = 8.0
_GIB = 1 << 30


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str  # the connector that moves the blocks; one of CONNECTORS
    kv_role: KVRole  # producer (prefill instance), consumer (decode instance) or both
    shared_dir: str  # the folder the producer writes block files to and the consumer reads them from
    shared_bytes: int  # consumer: bytes of the folder's files its disk tier keeps (LRU)

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(
                f"--kv-transfer-config: unknown kv_connector {self.kv_connector!r}; known: {list(CONNECTORS)}"
            )
        if self.kv_role not in ROLES:
            raise ValueError(
                f"--kv-transfer-config: kv_role must be one of {list(ROLES)}, got {self.kv_role!r}"
            )
        if not isinstance(self.shared_dir, str) or not self.shared_dir.strip():
            raise ValueError("--kv-transfer-config: kv_connector_extra_config.shared_dir must name a folder")
        if self.shared_bytes < 1:
            raise ValueError("--kv-transfer-config: shared_size_gib must be > 0")

    @property
    def produces(self) -> bool:
        """Whether this instance exports its prompts' full blocks (a prefill instance)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        """Whether this instance finds blocks another instance exported (a decode instance)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """Parse the flag's JSON; ValueError (one line) for bad JSON, an unknown key or a bad value."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--kv-transfer-config is not valid JSON: {error}") from error
        if not isinstance(values, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        _check_keys(values, _KEYS, "")
        extra = values.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
        _check_keys(extra, _EXTRA_KEYS, "kv_connector_extra_config ")
        for key in ("kv_connector", "kv_role"):
            if key not in values:
                raise ValueError(f"--kv-transfer-config needs {key}")
        size = extra.get("shared_size_gib", _DEFAULT_SHARED_GIB)
        if isinstance(size, bool) or not isinstance(size, int | float) or not 0 < size < math.inf:
            raise ValueError(f"--kv-transfer-config: shared_size_gib must be a positive number, got {size!r}")
        return cls(values["kv_connector"], values["kv_role"], extra.get("shared_dir", ""), int(size * _GIB))


def _check_keys(values: dict, known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"--kv-transfer-config has unknown {where}keys {unknown}; known: {list(known)}")
