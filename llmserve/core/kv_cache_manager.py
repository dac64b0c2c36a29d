"""Per-sequence block tables over the shared block pool. No tensors: the scheduler plans with it.

A request's block table maps its logical token positions to physical KV slots:

    positions  0 ..15 | 16..31 | 32..47 | 48..
    block ids  [  7   |   2    |   11   |  4 ]        slot of position p = table[p // B] * B + p % B
               '--- full, computed: cached by hash ---' '-- partial: private --'

Blocks are allocated as tokens arrive (`allocate_slots`) and all returned when the request
finishes, is aborted or is preempted (`free`). Waste is under one block per sequence.

Prefix caching: every full block whose KV has been computed is registered under a hash chained
over its parent block's hash and its own token ids (plus an optional extra key for anything else
that changes the KV), so a new request whose tokens start the same way reuses those blocks and
computes only the rest. Freed cached blocks stay valid in the pool's free queue until evicted.
"""

from __future__ import annotations

import hashlib
from array import array

from llmserve.core.block_pool import BlockPool
from llmserve.request import Request


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
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_swap_blocks: int = 0
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks else None  # CPU swap space
        self.block_tables: dict[str, list[int]] = {}
        self.swapped_tables: dict[str, list[int]] = {}  # request id -> its blocks in the swap space
        self._block_hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its full blocks
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already in the cache
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found in the cache
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (source, destination) blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

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
        if not self.enable_prefix_caching or request.num_computed_tokens:
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
        """Count one admitted request's lookup (not retries of a request that did not fit)."""
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
        for index in range(start, num_full):
            tokens = tuple(request.all_token_ids[index * size : (index + 1) * size])
            self.pool.cache_block(table[index], hashes[index], tokens)
        self._num_registered[rid] = num_full

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
        if computed_blocks:
            self.pool.incref(computed_blocks)
            table.extend(computed_blocks)
            self._num_registered[request.request_id] = len(computed_blocks)
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        return True

    def fork(self, source: Request, child: Request, num_tokens: int) -> None:
        """Let `child` share the blocks holding `source`'s first `num_tokens` tokens (parallel
        samples of one prompt). Blocks are reference counted; a shared partial block is copied by
        whichever request writes into it first."""
        shared = self.block_tables[source.request_id][: self.blocks_for(num_tokens)]
        self.pool.incref(shared)
        self.block_tables[child.request_id] = list(shared)
        self._num_registered[child.request_id] = num_tokens // self.block_size

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self.block_tables.pop(rid, None)
        self._num_registered.pop(rid, None)
        if table:
            self.pool.free(reversed(table))
        swapped = self.swapped_tables.pop(rid, None)
        if swapped:
            self.swap_pool.free(swapped)

    def free_excess_blocks(self, request: Request) -> None:
        """Speculative decoding: return the blocks past the request's computed tokens to the pool, i.e.
        blocks that held only rejected drafts. They are never in the prefix cache (only full blocks of
        computed tokens are registered) and never shared (allocated for this request's drafts)."""
        table = self.block_tables.get(request.request_id)
        keep = self.blocks_for(request.num_computed_tokens)
        if table is not None and len(table) > keep:
            self.pool.free(reversed(table[keep:]))
            del table[keep:]

    def forget(self, request: Request) -> None:
        """Drop the request's cached hashes once it is finished for good."""
        self._block_hashes.pop(request.request_id, None)

    # -- swapping ---------------------------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        table = self.block_tables.get(request.request_id, [])
        return self.swap_pool is not None and 0 < len(table) <= self.swap_pool.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the swap space; returns (device block, swap block) copies."""
        table = self.block_tables.pop(request.request_id)
        self._num_registered.pop(request.request_id, None)
        swap_blocks = self.swap_pool.allocate(len(table))
        self.swapped_tables[request.request_id] = swap_blocks
        self.pool.free(reversed(table))
        return list(zip(table, swap_blocks, strict=True))

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.swapped_tables

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped request back with room for `num_new_tokens` more; returns (swap block,
        device block) copies, or None (and changes nothing) if the pool lacks the blocks."""
        swap_blocks = self.swapped_tables[request.request_id]
        total = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        if total > self.pool.num_free_blocks:
            return None
        device_blocks = self.pool.allocate(total)
        self.block_tables[request.request_id] = device_blocks
        del self.swapped_tables[request.request_id]
        self.swap_pool.free(swap_blocks)
        return list(zip(swap_blocks, device_blocks, strict=False))

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def check_integrity(self) -> None:
        """Every used block is owned by exactly its ref count of tables; free + used = total."""
        self.pool.check_integrity()
        if self.swap_pool is not None:
            self.swap_pool.check_integrity()
            swap_owners = [0] * self.swap_pool.num_blocks
            for table in self.swapped_tables.values():
                for block in table:
                    swap_owners[block] += 1
            assert swap_owners == self.swap_pool.ref_counts, "swap tables and ref counts disagree"
        owners = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for block in table:
                owners[block] += 1
        assert owners == self.pool.ref_counts, "block tables and ref counts disagree"
