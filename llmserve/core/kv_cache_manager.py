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
current step's new tokens). Prefix caching is off with a window (the engine config turns it off).

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
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window  # 0: keep every block
        self.num_sink_blocks = cdiv(attention_sinks, block_size) if sliding_window else 0
        self._window_start: dict[str, int] = {}  # request id -> first table entry not yet freed
        self.num_window_evicted_blocks = 0
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, record_events=enable_kv_events and enable_prefix_caching)
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks else None  # CPU swap space
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
        """Blocks a decoding sequence holds at most: all of them without a window."""
        if not self.sliding_window:
            return self.pool.num_blocks
        return self.num_sink_blocks + cdiv(self.sliding_window, self.block_size) + 1

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether one sequence of this many tokens fits in the whole pool."""
        return self.blocks_for(num_tokens) <= self.pool.num_blocks

    # -- prefix cache -------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks that starts the request's tokens.

        At least one token is always left to compute, because the model must produce the logits
        of the last one.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens or request.needs_prompt_logprobs:
            return []
        hashes = self._hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens, size = request.all_token_ids, self.block_size
        hits = []
        for index, block_hash in enumerate(hashes[:max_blocks]):
            block = self.pool.lookup(block_hash, tuple(tokens[index * size : (index + 1) * size]))
            if block is None:
                break
            hits.append(block)
        return hits

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
        stored = []
        for index in range(start, num_full):
            tokens = tuple(request.all_token_ids[index * size : (index + 1) * size])
            if self.pool.cache_block(table[index], hashes[index], tokens):
                stored.append(index)
        self._num_registered[rid] = num_full
        if stored and self.pool.events is not None:
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
        if self.sliding_window:
            self._free_out_of_window(request, table)
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        needed = self.blocks_for(num_tokens) - len(table) - len(computed_blocks)
        revived = sum(1 for block in computed_blocks if self.pool.ref_counts[block] == 0)
        write_index = request.num_computed_tokens // self.block_size
        copy_on_write = write_index < len(table) and self.pool.ref_counts[table[write_index]] > 1
        if max(needed, 0) + revived + copy_on_write > self.pool.num_free_blocks:
            return False
        if copy_on_write:
            (private,) = self.pool.allocate(1)
            self.pending_copies.append((table[write_index], private))
            self.pool.free([table[write_index]])
            table[write_index] = private
            self.rewritten_tables.add(request.request_id)
        if computed_blocks:
            self.pool.incref(computed_blocks)
            table.extend(computed_blocks)
            self._num_registered[request.request_id] = len(computed_blocks)
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        return True

    def _free_out_of_window(self, request: Request, table: list[int]) -> None:
        """Return the blocks whose positions are all past the sinks and before the window of the next
        query (position num_computed_tokens): no query from now on can see them."""
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        end = min(max(first_visible, 0) // self.block_size, len(table))
        start = self._window_start.get(request.request_id, self.num_sink_blocks)
        if end <= start:
            return
        dead = [block for block in table[start:end] if block != NULL_BLOCK]
        self.pool.free(dead)
        table[start:end] = [NULL_BLOCK] * (end - start)
        self.rewritten_tables.add(request.request_id)
        self._window_start[request.request_id] = end
        self.num_window_evicted_blocks += len(dead)

    def fork(self, source: Request, child: Request, num_tokens: int) -> None:
        """Let `child` share the blocks holding `source`'s first `num_tokens` tokens (parallel
        samples of one prompt). Blocks are reference counted; a shared partial block is copied by
        whichever request writes into it first."""
        shared = self.block_tables[source.request_id][: self.blocks_for(num_tokens)]
        self.pool.incref(_live(shared))
        self.block_tables[child.request_id] = list(shared)
        if source.request_id in self._window_start:
            self._window_start[child.request_id] = self._window_start[source.request_id]
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
        are never in the prefix cache (only full blocks of computed tokens are registered) and never
        shared (allocated for this request's drafts)."""
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
        """Every used block is owned by exactly its ref count of tables; free + used = total."""
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


def _live(table: list[int]) -> list[int]:
    """The table's blocks, without entries freed by a sliding window."""
    return [block for block in table if block != NULL_BLOCK]
