"""The pool of KV-cache block ids: allocation, reference counts and the free queue.

Invariant (checked by `check_integrity`): every block id is either free (ref count 0, in the free
queue) or in use (ref count > 0, not in the queue); free + used = total.

The free queue is an ordered dict so that a block can be taken out of its middle in O(1): the prefix
cache keeps freed-but-still-valid blocks in the queue (least recently freed first) and revives one on
a hit. A cached block is evicted (its hash forgotten) only when `allocate` hands it out again.

With `record_events`, every change to the cache index is also appended to `events` (core/kv_events.py:
BlockRemoved here, BlockStored by the prefix cache, which knows each block's parent) until the
engine takes them after its step, so that the events replayed in order give exactly `_cached`'s keys
(with tiers: those keys and the tiers' ones, core/kv_tiers.py).

With `tiers`, a cached block handed out again is first offered to the RAM tier (core/kv_tiers.py),
which queues the copy of its KV before the step overwrites it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from llmserve.core.kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from llmserve.core.kv_tiers import KVTiers, TierSpec


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        record_events: bool = False,
        reuse_latest: bool = False,
        tiers: TierSpec | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        order = reversed(range(num_blocks)) if reuse_latest else range(num_blocks)  # block 0 goes first
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(order)
        self._cached: dict[bytes, int] = {}  # block hash -> block holding that content
        self._block_keys: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (hash, its tokens)
        self.num_evictions = 0
        self.events: list[KVCacheEvent] | None = [] if record_events else None  # None: not recorded
        # a pool without a prefix cache (swap space) hands out the blocks freed last: lazily mapped
        # memory then stays within the peak in use instead of every page being touched in turn
        self._take_latest = reuse_latest
        self.tiers = KVTiers(tiers, self) if tiers is not None else None  # RAM and disk under the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the head of the free queue (its tail with `reuse_latest`), each
        with ref count 1."""
        if count > len(self._free):
            raise NoFreeBlocksError(f"need {count} blocks, {len(self._free)} free")
        latest = self._take_latest
        blocks = [self._free.popitem(last=latest)[0] for _ in range(count)]
        evicted = []
        for block in blocks:
            self.ref_counts[block] = 1
            if (block_hash := self._evict(block)) is not None:
                evicted.append(block_hash)
        if evicted and self.events is not None:
            self.events.append(BlockRemoved(evicted, medium=None))
        return blocks

    # -- prefix cache -------------------------------------------------------------------------------

    def cache_block(self, block: int, block_hash: bytes, tokens: tuple[int, ...]) -> bool:
        """Remember that `block` holds the KV of a full block with this hash (first holder wins);
        whether the hash is new to the cache."""
        if block_hash in self._cached or block in self._block_keys:
            return False
        self._cached[block_hash] = block
        self._block_keys[block] = (block_hash, tokens)
        return True

    def lookup(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        """The cached block with this hash, if its tokens match too (a collision never hits)."""
        block = self._cached.get(block_hash)
        if block is None or self._block_keys[block][1] != tokens:
            return None
        return block

    def holds(self, block_hash: bytes) -> bool:
        """Whether a block of the pool is cached under this hash."""
        return block_hash in self._cached

    def is_cached(self, block: int) -> bool:
        return block in self._block_keys

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def _evict(self, block: int) -> bytes | None:
        """Forget the block's hash, if it had one; that hash, unless a tier keeps the block's KV."""
        key = self._block_keys.pop(block, None)
        if key is None:
            return None
        del self._cached[key[0]]
        self.num_evictions += 1
        if self.tiers is not None and self.tiers.offer(block, *key):
            return None
        return key[0]

    def reset_prefix_cache(self) -> None:
        self._cached.clear()
        self._block_keys.clear()
        if self.tiers is not None:
            self.tiers.reset()
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KVCacheEvent]:
        """The cache-index changes since the last call, oldest first."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def incref(self, blocks: Iterable[int]) -> None:
        """Share blocks: a free block (a prefix-cache hit) leaves the free queue."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the tail of the free queue.

        Callers pass a sequence's blocks last-first, so that its tail blocks (least likely to be a
        shared prefix) are evicted before its head blocks.
        """
        for block in blocks:
            if block < 0:  # a list index would take it for a block from the end (check_integrity)
                raise RuntimeError(f"block {block} is not a block of this pool")
            count = self.ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self.ref_counts[block] = count - 1
            if count == 1:
                self._free[block] = None

    def check_integrity(self) -> None:
        """Raise AssertionError if the free queue and the ref counts disagree. Passes at C speed (a
        swap pool may hold a million blocks, and a checked engine runs this every step): no count is
        negative, every queued block's is zero, and as many are zero as are queued (the queue's keys
        are distinct block ids: free() refuses any other), so the zero-count blocks are exactly the
        queue."""
        counts, free = self.ref_counts, self._free
        if len(free) == len(counts):  # all queued (an idle swap pool): then every count is zero
            broken = counts.count(0) != len(counts)
        else:
            broken = min(counts) < 0 or any(map(counts.__getitem__, free)) or counts.count(0) != len(free)
        if broken:
            block = next(b for b, count in enumerate(counts) if count < 0 or (count == 0) != (b in free))
            raise AssertionError(f"block {block}: ref {counts[block]}, free={block in free}")
        assert all(self._block_keys[b][0] == h for h, b in self._cached.items()), "cache index is stale"
        assert len(self._cached) == len(self._block_keys), "cache index is stale"
        if self.tiers is not None:
            self.tiers.check_integrity()
