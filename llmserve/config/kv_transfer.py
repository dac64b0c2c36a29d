"""KVTransferConfig: an engine started as a prefill or decode instance (vLLM's --kv-transfer-config).

vLLM's keys, given as one JSON object: `kv_connector` (which connector moves the blocks), `kv_role`
(`kv_producer`: a prefill instance that exports its prompts' full KV blocks; `kv_consumer`: a decode
instance that finds them as prefix-cache hits; `kv_both`: both) and `kv_connector_extra_config` (the
connector's own settings). Two connectors (worker/kv_transfer.py), both landing the blocks as disk-tier
files (core/kv_block_file.py) in the decode instance's folder `shared_dir`, of which its disk tier keeps
`shared_size_gib` (LRU):
- `LlmserveConnector`: the producer writes the files into `shared_dir` itself (one machine or a
  shared filesystem; both instances name the same folder);
- `LlmserveGlooConnector`: torch.distributed send/recv over gloo, one prefill and one decode instance
  (vLLM's 1P1D): the decode instance listens on vLLM's `kv_ip`/`kv_port` (a TCPStore for rendezvous),
  the prefill instance sends each step's blocks there and waits for the decode instance's
  acknowledgement, each transfer within `timeout_s`; `shared_dir` is the decode instance's own folder.
docs/data_parallel.md says what is not done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from llmserve.config.flags import json_object

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
ROLES = get_args(KVRole)
FOLDER, GLOO = "LlmserveConnector", "LlmserveGlooConnector"
CONNECTORS = (FOLDER, GLOO)
_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config", "kv_ip", "kv_port")
_EXTRA_KEYS = ("shared_dir", "shared_size_gib", "timeout_s")
_DEFAULT_SHARED_GIB = 8.0
_DEFAULT_IP, _DEFAULT_PORT = "127.0.0.1", 14579  # vLLM's defaults
_DEFAULT_TIMEOUT_S = 10.0
_GIB = 1 << 30


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str  # the connector that moves the blocks; one of CONNECTORS
    kv_role: KVRole  # producer (prefill instance), consumer (decode instance) or both
    shared_dir: (
        str  # the consumer's folder of transferred block files (LlmserveConnector: the producer's too)
    )
    shared_bytes: int  # consumer: bytes of the folder's files its disk tier keeps (LRU)
    kv_ip: str = _DEFAULT_IP  # gloo: the decode instance's address (its TCPStore for rendezvous)
    kv_port: int = _DEFAULT_PORT  # gloo: the port it listens on
    timeout_s: float = _DEFAULT_TIMEOUT_S  # gloo: one transfer's limit (connect, send, acknowledgement)

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(
                f"--kv-transfer-config: unknown kv_connector {self.kv_connector!r}; known: {list(CONNECTORS)}"
            )
        if self.kv_role not in ROLES:
            raise ValueError(
                f"--kv-transfer-config: kv_role must be one of {list(ROLES)}, got {self.kv_role!r}"
            )
        needs_dir = self.consumes or self.kv_connector == FOLDER  # a gloo producer writes no files
        if needs_dir and (not isinstance(self.shared_dir, str) or not self.shared_dir.strip()):
            raise ValueError("--kv-transfer-config: kv_connector_extra_config.shared_dir must name a folder")
        if (
            not isinstance(self.kv_port, int)
            or isinstance(self.kv_port, bool)
            or not 0 < self.kv_port < 65536
        ):
            raise ValueError(f"--kv-transfer-config: kv_port must be a port number, got {self.kv_port!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError("--kv-transfer-config: kv_ip must be a host name or address")
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
        values = json_object(text, "--kv-transfer-config")
        _check_keys(values, _KEYS, "")
        extra = values.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
        _check_keys(extra, _EXTRA_KEYS, "kv_connector_extra_config ")
        for key in ("kv_connector", "kv_role"):
            if key not in values:
                raise ValueError(f"--kv-transfer-config needs {key}")
        if values["kv_connector"] == FOLDER and ({"kv_ip", "kv_port"} & set(values) or "timeout_s" in extra):
            raise ValueError("--kv-transfer-config: kv_ip, kv_port and timeout_s are LlmserveGlooConnector's")
        size = _positive(extra.get("shared_size_gib", _DEFAULT_SHARED_GIB), "shared_size_gib")
        return cls(
            values["kv_connector"],
            values["kv_role"],
            extra.get("shared_dir", ""),
            int(size * _GIB),
            values.get("kv_ip", _DEFAULT_IP),
            values.get("kv_port", _DEFAULT_PORT),
            _positive(extra.get("timeout_s", _DEFAULT_TIMEOUT_S), "timeout_s"),
        )


def _positive(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"--kv-transfer-config: {name} must be a positive number, got {value!r}")
    return value


def _check_keys(values: dict, known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"--kv-transfer-config has unknown {where}keys {unknown}; known: {list(known)}")
