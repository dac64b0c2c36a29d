"""Prefill/decode disaggregation, the scheduler's side (no tensors): which blocks a prefill instance
exports, and when.

A prefill instance (`kv_role` kv_producer or kv_both, config/kv_transfer.py) exports a request's full
prompt blocks in the step that computes the last of its prompt: the step plan carries them as
`KVExport`s (device block, chained hash, tokens), and the model runner hands them to its connector
after that step's forward has written their KV (worker/kv_transfer.py), so they are sent before the
request's output leaves the engine. A decode instance finds them by hash through its tiers
(core/kv_tiers.py: the shared-folder connector's blocks are disk-tier files) as prefix-cache hits.

The block hashes are the prefix cache's chained hashes, the same on every instance of one model (no
per-process seed), which is what lets another engine look the blocks up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from llmserve.core.prefix_cache import PrefixCache
from llmserve.request import Request


class KVExport(msgspec.Struct, array_like=True, gc=False):
    """One full prompt block a prefill instance sends once the step's forward has written it."""

    block: int  # device block
    block_hash: bytes  # the prefix cache's chained hash (the receiver's lookup key)
    tokens: tuple[int, ...]  # the block's tokens (checked by the receiver, as a prefix hit does)


class ExportPlanner:
    def __init__(self, prefix_cache: PrefixCache, block_tables, block_size: int) -> None:
        """`block_tables`: request id -> its block table (`KVCacheManager.get_block_table`)."""
        self.prefix_cache = prefix_cache
        self.block_tables = block_tables
        self.block_size = block_size

    def exports(self, requests: Sequence[Request], num_scheduled: Mapping[str, int]) -> list[KVExport]:
        """The full prompt blocks of each request whose prompt this step finishes computing."""
        exports: list[KVExport] = []
        for request in requests:
            before = request.num_computed_tokens
            if before < request.num_prompt_tokens <= before + num_scheduled[request.request_id]:
                exports += self._prompt_blocks(request)
        return exports

    def _prompt_blocks(self, request: Request) -> list[KVExport]:
        size = self.block_size
        table = self.block_tables(request.request_id)
        hashes = self.prefix_cache.block_hashes(request)[: request.num_prompt_tokens // size]
        tokens = request.all_token_ids
        return [
            KVExport(table[index], block_hash, tuple(tokens[index * size : (index + 1) * size]))
            for index, block_hash in enumerate(hashes)
        ]
