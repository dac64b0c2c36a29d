"""Automatic prefix caching: which of a request's leading blocks are already in the pool.

Every full block whose KV has been computed is registered in the pool's cache index under a hash
chained over its parent block's hash and its own token ids (plus an optional extra key for anything
else that changes the KV), so a new request whose tokens start the same way reuses those blocks and
computes only the rest. Freed cached blocks stay valid in the pool's free queue until the pool hands
them out again (core/block_pool.py evicts them then). A hit checks the tokens too.

With KV-cache groups the cache key carries the group (a block's KV is of its group's layers), and
the hit of a request is the longest one every group's manager accepts (core/attention_managers.py:
a sliding group needs only the blocks of the last window before the hit's end).

With `record_events` on the pool, each block newly registered is recorded as a `BlockStored` event
(core/kv_events.py) naming its parent, for a router that routes requests to the replica holding
their prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from functools import partial

from llmserve.core.attention_managers import GroupManager
from llmserve.core.block_pool import BlockPool
from llmserve.core.block_tables import NULL_BLOCK
from llmserve.core.kv_events import BlockStored
from llmserve.core.kv_tiers import TIER_BLOCK
from llmserve.request import Request


def hash_block(parent_hash: bytes, tokens: tuple[int, ...], extra_key: bytes = b"") -> bytes:
    """SHA-256 over the parent's hash, the block's token ids and any extra key."""
    digest = hashlib.sha256(parent_hash)
    digest.update(array("q", tokens).tobytes())
    digest.update(extra_key)
    return digest.digest()


class PrefixCache:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        groups: tuple[GroupManager, ...],
        enabled: bool = True,
        hit_multiple: int = 1,
    ) -> None:
        """`hit_multiple`: hits are whole multiples of this many blocks (KVCacheManager's window_blocks)."""
        self.hit_multiple = hit_multiple
        self.pool = pool
        self.block_size = block_size
        self.groups = groups
        self.enabled = enabled
        self._by_group = len(groups) > 1 or any(manager.window for manager in groups)
        self._hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its full blocks
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already in the cache

    def block_hashes(self, request: Request) -> list[bytes]:
        """Chained hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = self._hashes.setdefault(request.request_id, [])
        size, tokens = self.block_size, request.all_token_ids
        for index in range(len(hashes), len(tokens) // size):
            # the first block's hash carries the request's LoRA adapter (an adapter changes every
            # layer's KV), and the chain carries it to the others
            parent, extra = (hashes[-1], b"") if hashes else (b"", request.lora_key)
            hashes.append(hash_block(parent, tuple(tokens[index * size : (index + 1) * size]), extra))
        return hashes

    def longest_hit(self, request: Request) -> list[int]:
        """The longest run of cached blocks that starts the request's tokens (with groups: the flat
        entries of every group, NULL_BLOCK where a sliding group needs no block; with tiers,
        TIER_BLOCK where the block is in RAM or on disk, core/kv_tiers.py).

        At least one token is always left to compute, because the model must produce the logits
        of the last one.
        """
        if not self.enabled or request.num_computed_tokens or request.needs_prompt_logprobs:
            return []
        hashes = self.block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self._by_group:
            return self._hit_by_group(request, hashes, max_blocks)
        tokens, size = request.all_token_ids, self.block_size
        hits = []
        tiers = self.pool.tiers
        for index, block_hash in enumerate(hashes[:max_blocks]):
            block_tokens = tuple(tokens[index * size : (index + 1) * size])
            block = self.pool.lookup(block_hash, block_tokens)
            if block is None and tiers is not None and tiers.find(block_hash, block_tokens):
                block = TIER_BLOCK  # in RAM or on disk: the cache manager loads it into a fresh block
            if block is None:
                break
            hits.append(block)
        return hits[: len(hits) - len(hits) % self.hit_multiple]

    def _hit_by_group(self, request: Request, hashes: list[bytes], max_blocks: int) -> list[int]:
        """The longest hit of `max_blocks` blocks at most that every group has (each group's hit
        shrinks the candidate until all agree), as flat table entries."""
        found: list[dict[int, int | None]] = [{} for _ in self.groups]

        def lookup(group: int, index: int) -> int | None:
            if index not in found[group]:
                size = self.block_size
                tokens = tuple(request.all_token_ids[index * size : (index + 1) * size])
                found[group][index] = self.pool.lookup(self._key(hashes[index], group), tokens)
            return found[group][index]

        num_hit = max_blocks
        while True:
            agreed = num_hit
            for group, manager in enumerate(self.groups):
                agreed = manager.hit_length(agreed, partial(lookup, group))
            if agreed == num_hit:
                break
            num_hit = agreed
        entries = []
        for index in range(num_hit):
            for group, manager in enumerate(self.groups):
                needed = index >= manager.first_visible_block(num_hit * self.block_size)
                entries.append(lookup(group, index) if needed else NULL_BLOCK)
        return entries

    def _key(self, block_hash: bytes, group: int) -> bytes:
        """The cache key of a block of `group` (the plain hash with one group)."""
        return block_hash if len(self.groups) == 1 else block_hash + bytes((group,))

    def register(self, request: Request, table: list[int]) -> None:
        """Register the request's full blocks whose KV is now computed (after each step); with
        groups, each group's live blocks under its own key."""
        if not self.enabled:
            return
        rid, size, groups = request.request_id, self.block_size, len(self.groups)
        num_full = request.num_computed_tokens // size
        start = self._num_registered.get(rid, 0)
        if num_full <= start:
            return
        hashes, stored = self.block_hashes(request), []
        for index in range(start, num_full):
            tokens = tuple(request.all_token_ids[index * size : (index + 1) * size])
            for group in range(groups):
                block, key = table[index * groups + group], self._key(hashes[index], group)
                if block != NULL_BLOCK and self.pool.cache_block(block, key, tokens):
                    stored.append(index)
        self._num_registered[rid] = num_full
        if stored and self.pool.events is not None:  # one group only (config refuses events with more)
            self._record_stored(hashes, request.all_token_ids, stored)

    def _record_stored(self, hashes: list[bytes], tokens, indices: list[int]) -> None:
        """One BlockStored event per run of consecutive blocks new to the cache."""
        size, runs = self.block_size, [[indices[0]]]
        for index in indices[1:]:
            if index == runs[-1][-1] + 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, end = run[0], run[-1] + 1
            parent = hashes[first - 1] if first else None
            block_tokens = list(tokens[first * size : end * size])
            self.pool.events.append(BlockStored(hashes[first:end], parent, block_tokens, size, None, None))

    def set_registered(self, request_id: str, num_blocks: int) -> None:
        """The request's first `num_blocks` blocks are in the cache already (a hit, or a fork's share)."""
        self._num_registered[request_id] = num_blocks

    def drop(self, request_id: str) -> None:
        """The request's blocks left the device (freed or swapped out): register them afresh."""
        self._num_registered.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """Drop the request's hashes once it is finished for good."""
        self._hashes.pop(request_id, None)
