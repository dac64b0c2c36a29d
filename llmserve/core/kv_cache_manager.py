"""Per-sequence block tables over the shared block pool. No tensors: the scheduler plans with it.

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
(`_sliding_hit`); the hit of the request is the longest one every group has (`_hybrid_hit`). Cache
keys carry the group (a block's KV is of its group's layers).

Prefix caching: every full block whose KV has been computed is registered under a hash chained
over its parent block's hash and its own token ids (plus an optional extra key for anything else
that changes the KV), so a new request whose tokens start the same way reuses those blocks and
computes only the rest. Freed cached blocks stay valid in the pool's free queue until evicted.
With `enable_kv_events`, each change to that cache is recorded as a KV event (core/kv_events.py),
for a router that routes requests to the replica holding their prefix.
"""

from __future__ import annotations

import hashlib
from array import array

from llmserve.core.block_pool import BlockPool
from llmserve.core.kv_events import BlockStored, KVCacheEvent
from llmserve.request import Request

NULL_BLOCK = -1  # a block-table entry whose block left the sliding window (attention never reads it)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent_hash: bytes, tokens: tuple[int, ...], extra_key: bytes = b"") -> bytes:
    """SHA-256 over the parent's hash, the block's token ids and any extra key."""
    digest = hashlib.sha256(parent_hash)
    digest.update(array("q", tokens).tobytes())
    digest.update(extra_key)
    return digest.digest()


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
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window  # 0: keep every block
        # KV-cache groups' windows (0: global); None: one group of every layer with `sliding_window`
        self.windows = group_windows if group_windows is not None else (sliding_window,)
        self.num_groups = len(self.windows)
        if self.num_groups > 1 and attention_sinks:
            raise ValueError("attention sinks apply to a model-wide window, not per-layer windows")
        if self.num_groups > 1 and enable_kv_events and enable_prefix_caching:
            raise ValueError("KV events do not combine with per-layer KV-cache groups (sliding layers)")
        self.has_window = any(self.windows)
        self.num_sink_blocks = cdiv(attention_sinks, block_size) if self.has_window else 0
        # request id -> per group, the first logical block not yet freed by its window
        self._window_start: dict[str, list[int]] = {}
        self.num_window_evicted_blocks = 0
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, record_events=enable_kv_events and enable_prefix_caching)
        # CPU swap space
        self.swap_pool = BlockPool(num_swap_blocks, reuse_latest=True) if num_swap_blocks else None
        self.block_tables: dict[str, list[int]] = {}
        self.swapped_tables: dict[str, list[int]] = {}  # request id -> its blocks in the swap space
        self._block_hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its full blocks
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already in the cache
        self.prefix_cache_queries = 0  # prompt tokens looked up (first admissions only)
        self.prefix_cache_hits = 0  # of which found in the cache
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (source, destination) blocks
        # requests whose table changed other than by appending (copy on write, window, rollback): the
        # scheduler sends the model runner their whole table next time (core/step_plan.py)
        self.rewritten_tables: set[str] = set()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def swap_usage(self) -> float:
        """Fraction of the CPU swap space's blocks in use (0 without one)."""
        return self.swap_pool.usage if self.swap_pool is not None else 0.0

    @property
    def max_blocks_per_sequence(self) -> int:
        """Blocks a decoding sequence holds at most: all of them while a group keeps every block."""
        if not all(self.windows):
            return self.pool.num_blocks
        return sum(self.max_blocks_in_group(g) for g in range(self.num_groups))

    def max_blocks_in_group(self, group: int) -> int:
        """Live blocks a decoding sequence holds in a sliding group: its sinks and its window."""
        return self.num_sink_blocks + cdiv(self.windows[group], self.block_size) + 1

    def blocks_for(self, num_tokens: int) -> int:
        """Table entries (all groups) covering `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size) * self.num_groups

    def num_cached_tokens(self, computed_blocks: list[int]) -> int:
        """Tokens a prefix-cache hit (`get_computed_blocks`) covers."""
        return len(computed_blocks) // self.num_groups * self.block_size

    def num_missing_blocks(self, request: Request, computed_blocks: list[int] = ()) -> int:
        """Blocks the request would still take from the pool to hold all its tokens (an estimate
        for admission: a sliding group takes at most its window's)."""
        table = self.block_tables.get(request.request_id, computed_blocks)
        logical = cdiv(request.num_tokens, self.block_size)
        if not self.has_window:
            return max(0, logical * self.num_groups - len(table))
        missing = 0
        for group, window in enumerate(self.windows):
            entries = table[group :: self.num_groups]
            want = min(logical, self.max_blocks_in_group(group)) if window else logical
            missing += max(0, want - len(_live(entries)))
        return missing

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether one sequence of this many tokens fits in the whole pool."""
        return self.blocks_for(num_tokens) <= self.pool.num_blocks

    def group_table(self, request_id: str, group: int) -> list[int]:
        """One group's block table of the request (NULL_BLOCK where its window freed a block)."""
        return self.block_tables.get(request_id, [])[group :: self.num_groups]

    def _key(self, block_hash: bytes, group: int) -> bytes:
        """The cache key of a block of `group` (the plain hash with one group)."""
        return block_hash if self.num_groups == 1 else block_hash + bytes((group,))

    # -- prefix cache -------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks that starts the request's tokens (with groups: the flat
        entries of every group, NULL_BLOCK where a sliding group needs no block).

        At least one token is always left to compute, because the model must produce the logits
        of the last one.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens or request.needs_prompt_logprobs:
            return []
        hashes = self._hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.has_window:
            return self._hybrid_hit(request, hashes, max_blocks)
        tokens, size = request.all_token_ids, self.block_size
        hits = []
        for index, block_hash in enumerate(hashes[:max_blocks]):
            block = self.pool.lookup(block_hash, tuple(tokens[index * size : (index + 1) * size]))
            if block is None:
                break
            hits.append(block)
        return hits

    def _hybrid_hit(self, request: Request, hashes: list[bytes], max_blocks: int) -> list[int]:
        """The longest hit of `max_blocks` blocks at most that every group has (each group's hit
        shrinks the candidate until all agree), as flat table entries."""
        found: list[dict[int, int]] = [{} for _ in self.windows]

        def lookup(group: int, index: int) -> int | None:
            if index not in found[group]:
                size = self.block_size
                tokens = tuple(request.all_token_ids[index * size : (index + 1) * size])
                found[group][index] = self.pool.lookup(self._key(hashes[index], group), tokens)
            return found[group][index]

        num_hit = max_blocks
        while True:
            agreed = num_hit
            for group, window in enumerate(self.windows):
                agreed = self._group_hit(group, window, agreed, lookup)
            if agreed == num_hit:
                break
            num_hit = agreed
        entries = []
        for index in range(num_hit):
            for group, window in enumerate(self.windows):
                needed = not window or index >= self._first_needed_block(num_hit * self.block_size, window)
                entries.append(lookup(group, index) if needed else NULL_BLOCK)
        return entries

    def _group_hit(self, group: int, window: int, limit: int, lookup) -> int:
        """The most blocks (<= limit) this group can adopt: a global group's leading run of cached
        blocks; a sliding group's longest hit whose last window's blocks are all cached."""
        if not window:
            return next((i for i in range(limit) if lookup(group, i) is None), limit)
        end = limit  # candidate hit: blocks [first needed, end) must be cached
        for index in range(limit - 1, -1, -1):
            if lookup(group, index) is None:
                end = index
            elif index <= self._first_needed_block(end * self.block_size, window):
                return end
        return 0

    def _first_needed_block(self, position: int, window: int) -> int:
        """The first block a query at `position` can see under `window` (sinks aside)."""
        return max(position - window + 1, 0) // self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a request's lookup at its first admission (not retries of a request that did not fit,
        nor the lookup of a preempted request's recompute: it would count its own blocks as hits)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed (called after each step)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_registered.get(rid, 0)
        if num_full <= start:
            return
        table, hashes, size = self.block_tables[rid], self._hashes(request), self.block_size
        if self.has_window:
            self._cache_group_blocks(request, table, hashes, start, num_full)
            return
        stored = []
        for index in range(start, num_full):
            tokens = tuple(request.all_token_ids[index * size : (index + 1) * size])
            if self.pool.cache_block(table[index], hashes[index], tokens):
                stored.append(index)
        self._num_registered[rid] = num_full
        if stored and self.pool.events is not None:
            self._record_stored(hashes, request.all_token_ids, stored)

    def _cache_group_blocks(self, request: Request, table, hashes, start: int, num_full: int) -> None:
        """cache_computed_blocks with groups (or a window): each group's live blocks under its key."""
        size, groups, stored = self.block_size, self.num_groups, []
        for index in range(start, num_full):
            tokens = tuple(request.all_token_ids[index * size : (index + 1) * size])
            for group in range(groups):
                block = table[index * groups + group]
                if block != NULL_BLOCK and self.pool.cache_block(
                    block, self._key(hashes[index], group), tokens
                ):
                    stored.append(index)
        self._num_registered[request.request_id] = num_full
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

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call (empty unless enable_kv_events)."""
        return self.pool.take_events()

    def _hashes(self, request: Request) -> list[bytes]:
        """Chained hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        size, tokens = self.block_size, request.all_token_ids
        for index in range(len(hashes), len(tokens) // size):
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, tuple(tokens[index * size : (index + 1) * size])))
        return hashes

    # -- allocation ---------------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` after the computed tokens (and after `computed_blocks`, a
        prefix-cache hit being adopted by a new request); all or nothing.

        If the first block to be written is shared (a fork's partial last block), it is copied
        first: the copy is queued in `pending_copies` for the model runner.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        if self.has_window:
            self._free_out_of_window(request, table)
        num_tokens = request.num_computed_tokens + self.num_cached_tokens(computed_blocks) + num_new_tokens
        needed = self.blocks_for(num_tokens) - len(table) - len(computed_blocks)
        revived = sum(
            1 for block in computed_blocks if block != NULL_BLOCK and self.pool.ref_counts[block] == 0
        )
        shared = self._shared_write_entries(request, table)
        if max(needed, 0) + revived + len(shared) > self.pool.num_free_blocks:
            return False
        for entry in shared:
            (private,) = self.pool.allocate(1)
            self.pending_copies.append((table[entry], private))
            self.pool.free([table[entry]])
            table[entry] = private
            self.rewritten_tables.add(request.request_id)
        if computed_blocks:
            self.pool.incref(_live(computed_blocks))
            table.extend(computed_blocks)
            num_hit = len(computed_blocks) // self.num_groups
            self._num_registered[request.request_id] = num_hit
            if self.has_window:
                self._window_start[request.request_id] = [
                    self._first_needed_block(num_hit * self.block_size, w) if w else 0 for w in self.windows
                ]
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        return True

    def _shared_write_entries(self, request: Request, table: list[int]) -> list[int]:
        """Entries of the first block to be written that are shared (a fork's partial last block)."""
        first = request.num_computed_tokens // self.block_size * self.num_groups
        return [
            entry
            for entry in range(first, min(first + self.num_groups, len(table)))
            if table[entry] != NULL_BLOCK and self.pool.ref_counts[table[entry]] > 1
        ]

    def _free_out_of_window(self, request: Request, table: list[int]) -> None:
        """Return each sliding group's blocks whose positions are all past the sinks and before the
        window of the next query (position num_computed_tokens): no query from now on can see them."""
        groups, rid = self.num_groups, request.request_id
        starts = self._window_start.setdefault(rid, [self.num_sink_blocks] * groups)
        num_logical = len(table) // groups
        dead = []
        for group, window in enumerate(self.windows):
            end = min(self._first_needed_block(request.num_computed_tokens, window), num_logical)
            if not window or end <= starts[group]:
                continue
            for entry in range(starts[group] * groups + group, end * groups, groups):
                if table[entry] != NULL_BLOCK:
                    dead.append(table[entry])
                    table[entry] = NULL_BLOCK
            starts[group] = end
        if dead:
            self.pool.free(dead)
            self.rewritten_tables.add(rid)
            self.num_window_evicted_blocks += len(dead)

    def fork(self, source: Request, child: Request, num_tokens: int) -> None:
        """Let `child` share the blocks holding `source`'s first `num_tokens` tokens (parallel
        samples of one prompt). Blocks are reference counted; a shared partial block is copied by
        whichever request writes into it first."""
        shared = self.block_tables[source.request_id][: self.blocks_for(num_tokens)]
        self.pool.incref(_live(shared))
        self.block_tables[child.request_id] = list(shared)
        if source.request_id in self._window_start:
            self._window_start[child.request_id] = list(self._window_start[source.request_id])
        self._num_registered[child.request_id] = num_tokens // self.block_size

    def take_rewritten_tables(self) -> set[str]:
        rewritten, self.rewritten_tables = self.rewritten_tables, set()
        return rewritten

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self.block_tables.pop(rid, None)
        self._num_registered.pop(rid, None)
        self._window_start.pop(rid, None)
        if table:
            self.pool.free(reversed(_live(table)))
        swapped = self.swapped_tables.pop(rid, None)
        if swapped:
            self.swap_pool.free(swapped)

    def free_excess_blocks(self, request: Request) -> None:
        """Speculative decoding: return the blocks past the request's computed tokens to the pool, i.e.
        blocks that held only rejected drafts or a proposer's lookahead (core/draft_planner.py). They
        are never in the prefix cache (only full blocks of computed tokens are registered), never
        shared (allocated for this request's drafts) and never freed by a window (they are past every
        query's window start)."""
        table = self.block_tables.get(request.request_id)
        keep = self.blocks_for(request.num_computed_tokens)
        if table is not None and len(table) > keep:
            self.pool.free(reversed(table[keep:]))
            del table[keep:]
            self.rewritten_tables.add(request.request_id)

    def forget(self, request: Request) -> None:
        """Drop the request's cached hashes once it is finished for good."""
        self._block_hashes.pop(request.request_id, None)

    # -- swapping ---------------------------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        live = _live(self.block_tables.get(request.request_id, []))
        return self.swap_pool is not None and 0 < len(live) <= self.swap_pool.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the swap space; returns (device block, swap block) copies.
        Entries freed by a sliding window stay NULL_BLOCK in the swapped table."""
        table = self.block_tables.pop(request.request_id)
        self._num_registered.pop(request.request_id, None)
        live = _live(table)
        swap_blocks = iter(self.swap_pool.allocate(len(live)))
        swapped = [NULL_BLOCK if block == NULL_BLOCK else next(swap_blocks) for block in table]
        self.swapped_tables[request.request_id] = swapped
        self.pool.free(reversed(live))
        return list(zip(live, _live(swapped), strict=True))

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.swapped_tables

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped request back with room for `num_new_tokens` more; returns (swap block,
        device block) copies, or None (and changes nothing) if the pool lacks the blocks."""
        swapped = self.swapped_tables[request.request_id]
        num_freed = len(swapped) - len(_live(swapped))  # left a sliding window before the swap
        total = self.blocks_for(request.num_computed_tokens + num_new_tokens) - num_freed
        if total > self.pool.num_free_blocks:
            return None
        device_blocks = iter(self.pool.allocate(total))
        table = [NULL_BLOCK if block == NULL_BLOCK else next(device_blocks) for block in swapped]
        self.block_tables[request.request_id] = table + list(device_blocks)
        del self.swapped_tables[request.request_id]
        self.swap_pool.free(_live(swapped))
        return list(zip(_live(swapped), _live(table), strict=True))

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def check_integrity(self) -> None:
        """Every used block is owned by exactly its ref count of tables; free + used = total; per
        group, a block belongs to one group only, a global group has no holes and a sliding group
        holds nothing before its window start."""
        self.pool.check_integrity()
        if self.swap_pool is not None:
            self.swap_pool.check_integrity()
            swap_owners = [0] * self.swap_pool.num_blocks
            for table in self.swapped_tables.values():
                for block in _live(table):
                    swap_owners[block] += 1
            assert swap_owners == self.swap_pool.ref_counts, "swap tables and ref counts disagree"
        owners = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for block in _live(table):
                owners[block] += 1
        assert owners == self.pool.ref_counts, "block tables and ref counts disagree"
        if self.num_groups > 1 or self.has_window:
            self._check_groups()

    def _check_groups(self) -> None:
        groups, group_of = self.num_groups, {}
        for rid, table in self.block_tables.items():
            assert len(table) % groups == 0, f"{rid}: table of {len(table)} entries for {groups} groups"
            starts = self._window_start.get(rid, [self.num_sink_blocks] * groups)
            for entry, block in enumerate(table):
                group, index = entry % groups, entry // groups
                if block == NULL_BLOCK:
                    assert self.windows[group], f"{rid}: a hole in global group {group}"
                    continue
                assert group_of.setdefault(block, group) == group, f"block {block} is in two groups"
                if self.windows[group]:
                    sinks = index < self.num_sink_blocks
                    assert sinks or index >= starts[group], (
                        f"{rid}: block {block} left group {group}'s window"
                    )


def _live(table: list[int]) -> list[int]:
    """The table's blocks, without entries freed by a sliding window."""
    return [block for block in table if block != NULL_BLOCK]
