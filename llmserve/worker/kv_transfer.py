"""Prefill/decode disaggregation, the model runner's side: the connector that sends a prefill
instance's exported blocks (core/kv_transfer.py) to where a decode instance finds them.

A connector has two halves. The sender (`KVConnector.send`, here) runs in the producer's model runner
after the forward that wrote the blocks, before the step's output leaves the engine. The receiver is
the decode instance's tiers (core/kv_tiers.py): a lookup that misses asks the connector's inbox for the
block, and a block found there is loaded as a disk hit. A connector over another transport
(torch.distributed send/recv, the Ray object store) implements `send` and an inbox the tiers ask.

`SharedFolderConnector` ("LlmserveConnector") is the single-machine / shared-filesystem connector: it
writes each block as a disk-tier file (core/kv_block_file.py: checked, written under a temporary name
and renamed) into the model's subfolder of `shared_dir`, the same subfolder a decode instance of the
same model uses as its disk tier.
"""

from __future__ import annotations

import abc
import logging
from pathlib import Path

import torch

from llmserve.config import EngineConfig
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
        block_shape = (*kv_blocks.shape[:2], *kv_blocks.shape[3:])
        self.model_key = model_fingerprint(config, block_shape, kv_blocks.dtype)
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


CONNECTORS: dict[str, type[KVConnector]] = {"LlmserveConnector": SharedFolderConnector}


def create_connector(config: EngineConfig, kv_blocks: torch.Tensor) -> KVConnector | None:
    """A prefill instance's connector (--kv-transfer-config with kv_producer or kv_both); None otherwise."""
    transfer = config.cache.kv_transfer
    if transfer is None or not transfer.produces:
        return None
    return CONNECTORS[transfer.kv_connector](config, kv_blocks)
