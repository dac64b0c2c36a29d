"""The KV cache as the scheduler sees it: block tables over the shared block pool, no tensors.

`KVCacheManager` is the one object the scheduler and the engine talk to; it coordinates the parts
that own the state:

    core/block_pool.py          block ids, reference counts, the free queue, the prefix-cache index
    core/block_tables.py        each request's block table (the layout below), copy on write
    core/attention_managers.py  one manager per KV-cache group by attention kind (full, sliding window)
    core/prefix_cache.py        block hashes, hit lookup, registration of computed blocks, KV events
    core/swap_space.py          the CPU swap space of preempted requests
    core/kv_tiers.py            RAM and disk tiers under the prefix cache (evicted blocks, loaded back)
    core/tier_hits.py           a prefix hit's blocks in those tiers, made into pool blocks

A request's block table maps its logical token positions to physical KV slots:

    positions  0 ..15 | 16..31 | 32..47 | 48..
    block ids  [  7   |   2    |   11   |  4 ]        slot of position p = table[p // B] * B + p % B
               '--- full, computed: cached by hash ---' '-- partial: private --'

Blocks are allocated as tokens arrive (`allocate_slots`) and all returned when the request
finishes, is aborted or is preempted (`free`). Waste is under one block per sequence.

Sliding window with attention sinks (StreamingLLM): a query at position p sees only the first S
tokens and the last W (p - W < k <= p). Before each allocation, blocks that no future query can see
return to the pool and their table entries become NULL_BLOCK; sink blocks and window blocks stay:

    positions  0..15 | 16..31 | 32..47 | 48..63 | 64..   (S = 4, W = 24, 70 tokens computed)
    block ids  [  7  |  NULL  |  NULL  |   11   |  4 ]
               sinks '-- freed, never read --' '- window -'

So a sequence holds at most ceil(S / B) + ceil(W / B) + 1 blocks however long it grows (plus its
current step's new tokens). Prefix caching is off with attention sinks (the engine config turns it off).

KV-cache groups (config/kv_groups.py): a model mixing sliding and global layers (Gemma 2/3) has one
block table per group, each with its own window (0: global). A request's tables are stored as one
flat list, the groups' entries interleaved (entry i * G + g: group g's i-th block), so the step plan
and the runner carry a single list; group g's table is `table[g::G]`. With one group (every model
without per-layer kinds) it is the plain table above:

    G = 2, group 0 global, group 1 window 8, B = 4, 14 tokens computed (next query sees 7..14)
    flat     [ 3, NULL | 5, NULL | 8, 9 | 10, 11 ]     group 0: [3, 5, 8, 10]
    logical      0        1        2       3           group 1: [NULL, NULL, 9, 11]

A sliding group's prefix-cache hit needs only the blocks of the last window before the hit's end
(`SlidingWindowManager.hit_length`); the hit of the request is the longest one every group has
(`PrefixCache.longest_hit`). Cache keys carry the group (a block's KV is of its group's layers).

Prefix caching: every full block whose KV has been computed is registered under a hash chained
over its parent block's hash and its own token ids (plus an optional extra key for anything else
that changes the KV), so a new request whose tokens start the same way reuses those blocks and
computes only the rest. Freed cached blocks stay valid in the pool's free queue until evicted.
With `enable_kv_events`, each change to that cache is recorded as a KV event (core/kv_events.py),
for a router that routes requests to the replica holding their prefix.

Integrity (`check_integrity`, called by the tests after every step and by `--check-invariants`):
every block is free or used (free + used = total; cached blocks wait in the free queue), every used
block is held by exactly its ref count of tables, and each table keeps its groups' layout.
"""

from __future__ import annotations

from llmserve.core.attention_managers import attention_managers
from llmserve.core.block_pool import BlockPool
from llmserve.core.block_tables import NULL_BLOCK, BlockTables, cdiv, live
from llmserve.core.kv_events import KVCacheEvent
from llmserve.core.kv_tiers import TIER_BLOCK, TierOp, TierSpec
from llmserve.core.prefix_cache import PrefixCache
from llmserve.core.swap_space import SwapSpace
from llmserve.core.tier_hits import TierHits
from llmserve.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_swap_blocks: int = 0,
        sliding_window: int = 0,
        attention_sinks: int = 0,
        enable_kv_events: bool = False,
        group_windows: tuple[int, ...] | None = None,
        tiers: TierSpec | None = None,
        window_blocks: int = 0,
    ) -> None:
        """`tiers`: RAM and disk under the prefix cache (core/kv_tiers.py); one global group only.
        `window_blocks` > 0 (int4/int2 caches): a sequence's blocks are read in full precision from its
        own window beside the pool (worker/recent_kv.py) until their span of this many blocks is
        complete, so prefix hits and forks share whole spans only (the window does not travel)."""
        self.hit_multiple = max(window_blocks, 1)
        # KV-cache groups' windows (0: global); None: one group of every layer with `sliding_window`
        windows = group_windows if group_windows is not None else (sliding_window,)
        if len(windows) > 1 and attention_sinks:
            raise ValueError("attention sinks apply to a model-wide window, not per-layer windows")
        if len(windows) > 1 and enable_kv_events and enable_prefix_caching:
            raise ValueError("KV events do not combine with per-layer KV-cache groups (sliding layers)")
        if tiers is not None and (len(windows) > 1 or any(windows)):
            raise ValueError("KV offloading does not combine with sliding-window layers yet")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_groups = len(windows)
        self.has_window = any(windows)
        num_sink_blocks = cdiv(attention_sinks, block_size) if self.has_window else 0
        self.groups = attention_managers(windows, block_size, num_sink_blocks)
        self.pool = BlockPool(
            num_blocks,
            record_events=enable_kv_events and enable_prefix_caching,
            tiers=tiers if enable_prefix_caching else None,
        )
        self.block_tables = BlockTables(self.pool, block_size, self.groups)
        self.prefix_cache = PrefixCache(
            self.pool, block_size, self.groups, enable_prefix_caching, self.hit_multiple
        )
        self.swap_space = SwapSpace(num_swap_blocks, self.pool)
        self.tier_hits = TierHits(self.pool, self.prefix_cache, block_size)
        # blocks a decoding sequence holds at most: all of them while a group keeps every block
        bounds = [group.max_blocks for group in self.groups]
        self.max_blocks_per_sequence = num_blocks if None in bounds else sum(bounds)
        self.prefix_cache_queries = 0  # prompt tokens looked up (first admissions only)
        self.prefix_cache_hits = 0  # of which found in the cache

    @property
    def usage(self) -> float:
        return self.pool.usage

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether one sequence of this many tokens fits in the whole pool."""
        return self.block_tables.entries_for(num_tokens) <= self.num_blocks

    def num_cached_tokens(self, computed_blocks: list[int]) -> int:
        """Tokens a prefix-cache hit (`get_computed_blocks`) covers."""
        return len(computed_blocks) // self.num_groups * self.block_size

    def num_missing_blocks(self, request: Request, computed_blocks: list[int] = ()) -> int:
        """Blocks the request would still take from the pool to hold all its tokens (an estimate
        for admission: a sliding group takes at most its window's)."""
        table = self.block_tables.by_request.get(request.request_id, computed_blocks)
        logical = cdiv(request.num_tokens, self.block_size)
        if not self.has_window:  # a tier's hit takes a fresh block each
            return max(0, logical * self.num_groups - len(table)) + table.count(TIER_BLOCK)
        return sum(
            max(0, group.blocks_wanted(logical) - len(live(table[index :: self.num_groups])))
            for index, group in enumerate(self.groups)
        )

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id)

    # -- prefix cache -------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks that starts the request's tokens, as table entries
        (`PrefixCache.longest_hit`); empty for a request already under way."""
        return self.prefix_cache.longest_hit(request)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a request's lookup at its first admission (not retries of a request that did not fit,
        nor the lookup of a preempted request's recompute: it would count its own blocks as hits)."""
        if self.prefix_cache.enabled:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed (called after each step)."""
        self.prefix_cache.register(request, self.block_tables.get(request.request_id))

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call (empty unless enable_kv_events)."""
        return self.pool.take_events()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and the lookup counts (the warm-up's, say: nothing of it may be
        hit or counted later); the clearing is an event like any other (`take_events`)."""
        self.pool.reset_prefix_cache()
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    # -- allocation ---------------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` after the computed tokens (and after `computed_blocks`, a
        prefix-cache hit being adopted by a new request); all or nothing.

        If the first block to be written is shared (a fork's partial last block), it is copied
        first: the copy is queued for the model runner (`take_pending_copies`).
        """
        rid, tables = request.request_id, self.block_tables
        table = tables.open(rid)
        if self.has_window:
            tables.free_out_of_window(rid, request.num_computed_tokens)
        num_tokens = request.num_computed_tokens + self.num_cached_tokens(computed_blocks) + num_new_tokens
        needed = tables.entries_for(num_tokens) - len(table) - len(computed_blocks)
        hit_blocks = [block for block in computed_blocks if block not in (NULL_BLOCK, TIER_BLOCK)]
        revived = sum(1 for block in hit_blocks if self.pool.ref_counts[block] == 0)
        num_loads = computed_blocks.count(TIER_BLOCK)  # blocks in a tier: a fresh block each
        shared = tables.shared_write_entries(rid, request.num_computed_tokens)
        if max(needed, 0) + revived + len(shared) + num_loads > self.pool.num_free_blocks:
            return False
        sources = self.tier_hits.fetch(request, computed_blocks)
        if sources is None:
            return False
        tables.copy_on_write(rid, shared)
        if num_loads:
            tables.adopt(rid, self.tier_hits.adopt(request, computed_blocks, sources))
            tables.grow(rid, [], needed)
        else:
            tables.grow(rid, computed_blocks, needed)
        if computed_blocks:
            num_hit = len(computed_blocks) // self.num_groups
            self.prefix_cache.set_registered(rid, num_hit)
            for group in self.groups:
                group.adopt_hit(rid, num_hit)
        return True

    def tier_hit_ready(self, request: Request, computed_blocks: list[int]) -> bool:
        """Whether the hit's blocks on disk have been read (their reads start now if not: the request
        waits while the steps go on, core/kv_tiers.py); True for a hit without tier blocks."""
        return self.tier_hits.ready(request, computed_blocks)

    def take_tier_ops(self) -> list[TierOp]:
        """The tiers' copies since the last call, for the step plan (empty without tiers)."""
        return self.pool.tiers.take_ops() if self.pool.tiers is not None else []

    def fork(self, source: Request, child: Request, num_tokens: int) -> None:
        """Let `child` share the blocks holding `source`'s first `num_tokens` tokens (parallel
        samples of one prompt). Blocks are reference counted; a shared partial block is copied by
        whichever request writes into it first."""
        self.block_tables.share(source.request_id, child.request_id, num_tokens)
        for group in self.groups:
            group.fork(source.request_id, child.request_id)
        self.prefix_cache.set_registered(child.request_id, num_tokens // self.block_size)

    def take_rewritten_tables(self) -> set[str]:
        return self.block_tables.take_rewritten()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        return self.block_tables.take_pending_copies()

    def free(self, request: Request) -> None:
        rid = request.request_id
        self.block_tables.release(rid)
        self.prefix_cache.drop(rid)
        for group in self.groups:
            group.free(rid)
        self.swap_space.free(rid)

    def free_excess_blocks(self, request: Request) -> None:
        """Speculative decoding: return the blocks past the request's computed tokens to the pool, i.e.
        blocks that held only rejected drafts or a proposer's lookahead (core/draft_planner.py). They
        are never in the prefix cache (only full blocks of computed tokens are registered), never
        shared (allocated for this request's drafts) and never freed by a window (they are past every
        query's window start)."""
        self.block_tables.truncate(request.request_id, request.num_computed_tokens)

    def forget(self, request: Request) -> None:
        """Drop the request's cached hashes once it is finished for good."""
        self.prefix_cache.forget(request.request_id)

    # -- swapping ---------------------------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        return self.swap_space.can_take(self.block_tables.get(request.request_id))

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the swap space; returns (device block, swap block) copies.
        Entries freed by a sliding window stay NULL_BLOCK in the swapped table."""
        table = self.block_tables.pop(request.request_id)
        self.prefix_cache.drop(request.request_id)
        return self.swap_space.swap_out(request.request_id, table)

    def is_swapped(self, request: Request) -> bool:
        return self.swap_space.holds(request.request_id)

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped request back with room for `num_new_tokens` more; returns (swap block,
        device block) copies, or None (and changes nothing) if the pool lacks the blocks."""
        num_entries = self.block_tables.entries_for(request.num_computed_tokens + num_new_tokens)
        swapped_in = self.swap_space.swap_in(request.request_id, num_entries)
        if swapped_in is None:
            return None
        table, moves = swapped_in
        self.block_tables.put(request.request_id, table)
        return moves

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + used = total in the device pool and the swap space, every
        used block is owned by exactly its ref count of tables, and per group, a block belongs to one
        group only, a global group has no holes and a sliding group holds nothing before its window."""
        self.pool.check_integrity()
        self.swap_space.check_integrity()
        self.block_tables.check_integrity()
