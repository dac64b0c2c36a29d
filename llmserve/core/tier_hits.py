"""A prefix hit's tier entries made into pool blocks, for the KV cache manager.

`PrefixCache.longest_hit` marks a block found in the RAM or disk tier (core/kv_tiers.py) as TIER_BLOCK;
before the hit is adopted, each such entry needs its source (a RAM slot, or a file's bytes read in the
background), then a fresh pool block, a queued load into it, and the block cached under its hash, so
that a concurrent request with the same prefix shares it instead of loading it again.
"""

from __future__ import annotations

from llmserve.core.block_pool import BlockPool
from llmserve.core.block_tables import NULL_BLOCK
from llmserve.core.kv_tiers import TIER_BLOCK, Key
from llmserve.core.prefix_cache import PrefixCache
from llmserve.request import Request


class TierHits:
    def __init__(self, pool: BlockPool, prefix_cache: PrefixCache, block_size: int) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.block_size = block_size

    def ready(self, request: Request, hit: list[int]) -> bool:
        """Whether the hit's blocks on disk have been read (their reads start now if not)."""
        keys = self._keys(request, hit)
        return not keys or self.pool.tiers.ready(keys)

    def fetch(self, request: Request, hit: list[int]) -> list[int | bytes] | None:
        """The sources of the hit's tier entries ([] without any); None if one is gone or its file bad:
        the admission waits and its next lookup stops before that block."""
        keys = self._keys(request, hit)
        return self.pool.tiers.fetch(keys) if keys else []

    def adopt(self, request: Request, hit: list[int], sources: list[int | bytes]) -> list[int]:
        """The hit's entries with fresh blocks in place of its tier entries, their loads queued and
        their hashes cached in the pool; every entry holds one reference for the request."""
        keys, tiers = self._keys(request, hit), self.pool.tiers
        self.pool.incref([block for block in hit if block not in (NULL_BLOCK, TIER_BLOCK)])  # unevictable now
        with tiers.pinned(keys):
            fresh = iter(self.pool.allocate(len(keys)))
        entries = [next(fresh) if block == TIER_BLOCK else block for block in hit]
        loaded = [block for block, old in zip(entries, hit, strict=True) if old == TIER_BLOCK]
        tiers.load(keys, sources, loaded)
        for block, (block_hash, tokens) in zip(loaded, keys, strict=True):
            self.pool.cache_block(block, block_hash, tokens)
        return entries

    def _keys(self, request: Request, hit: list[int]) -> list[Key]:
        """(hash, tokens) of each tier entry of the hit, in order."""
        indices = [index for index, block in enumerate(hit) if block == TIER_BLOCK]
        if not indices:
            return []
        hashes, tokens, size = self.prefix_cache.block_hashes(request), request.all_token_ids, self.block_size
        return [(hashes[i], tuple(tokens[i * size : (i + 1) * size])) for i in indices]
