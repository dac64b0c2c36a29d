"""Each request's block table over the device block pool: one flat list per request, the KV-cache
groups' entries interleaved (entry i * G + g: group g's i-th logical block; layout and diagrams in
core/kv_cache_manager.py).

Invariant (checked by `check_integrity`): a block's reference count in the pool is the number of
tables holding it; with groups, a block belongs to one group, a full-attention group has no holes
and a sliding group holds nothing its window has passed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmserve.core.block_pool import BlockPool

if TYPE_CHECKING:
    from llmserve.core.attention_managers import GroupManager

NULL_BLOCK = -1  # a block-table entry whose block left the sliding window (attention never reads it)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def live(table: list[int]) -> list[int]:
    """The table's blocks, without entries freed by a sliding window."""
    return [block for block in table if block != NULL_BLOCK]


class BlockTables:
    def __init__(self, pool: BlockPool, block_size: int, groups: tuple[GroupManager, ...]) -> None:
        self.pool = pool
        self.block_size = block_size
        self.groups = groups
        self.num_groups = len(groups)
        self.by_request: dict[str, list[int]] = {}
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (source, destination) blocks
        # requests whose table changed other than by appending (copy on write, window, rollback): the
        # scheduler sends the model runner their whole table next time (core/step_plan.py)
        self.rewritten: set[str] = set()
        self.num_window_evicted_blocks = 0

    def entries_for(self, num_tokens: int) -> int:
        """Table entries (all groups) covering `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size) * self.num_groups

    def get(self, request_id: str) -> list[int]:
        return self.by_request.get(request_id, [])

    def group(self, request_id: str, group: int) -> list[int]:
        """One group's block table of the request (NULL_BLOCK where its window freed a block)."""
        return self.get(request_id)[group :: self.num_groups]

    def open(self, request_id: str) -> list[int]:
        """The request's table, created empty for a request about to be given blocks."""
        return self.by_request.setdefault(request_id, [])

    def grow(self, request_id: str, hit: list[int], num_new: int) -> None:
        """Append a prefix-cache hit's entries (shared: their ref counts grow), then `num_new` new blocks."""
        table = self.by_request[request_id]
        if hit:
            self.pool.incref(live(hit))
            table.extend(hit)
        if num_new > 0:
            table.extend(self.pool.allocate(num_new))

    def adopt(self, request_id: str, entries: list[int]) -> None:
        """Append entries whose blocks already hold a reference for this request (a tier's hit)."""
        self.by_request[request_id].extend(entries)

    def free_out_of_window(self, request_id: str, position: int) -> None:
        """Return each sliding group's blocks that no query from `position` on can see."""
        table, groups = self.by_request[request_id], self.num_groups
        dead = []
        for group, manager in enumerate(self.groups):
            for index in manager.leaving_window(request_id, position, len(table) // groups):
                entry = index * groups + group
                if table[entry] != NULL_BLOCK:
                    dead.append(table[entry])
                    table[entry] = NULL_BLOCK
        if dead:
            self.pool.free(dead)
            self.rewritten.add(request_id)
            self.num_window_evicted_blocks += len(dead)

    def shared_write_entries(self, request_id: str, num_computed_tokens: int) -> list[int]:
        """Entries of the first block to be written that are shared (a fork's partial last block)."""
        table = self.by_request[request_id]
        first = num_computed_tokens // self.block_size * self.num_groups
        return [
            entry
            for entry in range(first, min(first + self.num_groups, len(table)))
            if table[entry] != NULL_BLOCK and self.pool.ref_counts[table[entry]] > 1
        ]

    def copy_on_write(self, request_id: str, entries: list[int]) -> None:
        """Give each entry a private block; the copy is queued in `pending_copies` for the model runner."""
        table = self.by_request[request_id]
        for entry in entries:
            (private,) = self.pool.allocate(1)
            self.pending_copies.append((table[entry], private))
            self.pool.free([table[entry]])
            table[entry] = private
            self.rewritten.add(request_id)

    def share(self, source_id: str, child_id: str, num_tokens: int) -> None:
        """Give the child the source's entries covering its first `num_tokens` tokens."""
        shared = self.by_request[source_id][: self.entries_for(num_tokens)]
        self.pool.incref(live(shared))
        self.by_request[child_id] = list(shared)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Return the blocks past the first `num_tokens` tokens to the pool."""
        table = self.by_request.get(request_id)
        keep = self.entries_for(num_tokens)
        if table is not None and len(table) > keep:
            self.pool.free(reversed(live(table[keep:])))  # a window's dropped entries hold no block
            del table[keep:]
            self.rewritten.add(request_id)

    def release(self, request_id: str) -> None:
        """Drop the request's table and its references, last block first (its tail, least likely to be
        a shared prefix, is then evicted first)."""
        table = self.by_request.pop(request_id, None)
        if table:
            self.pool.free(reversed(live(table)))

    def pop(self, request_id: str) -> list[int]:
        """Take the table out without freeing its blocks (the swap space frees them)."""
        return self.by_request.pop(request_id)

    def put(self, request_id: str, table: list[int]) -> None:
        self.by_request[request_id] = table

    def take_rewritten(self) -> set[str]:
        rewritten, self.rewritten = self.rewritten, set()
        return rewritten

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_integrity(self) -> None:
        """Raise AssertionError unless every used block is owned by exactly its ref count of tables
        and each table keeps its groups' layout."""
        owners = [0] * self.pool.num_blocks
        for table in self.by_request.values():
            for block in live(table):
                owners[block] += 1
        assert owners == self.pool.ref_counts, "block tables and ref counts disagree"
        if self.num_groups > 1 or any(manager.window for manager in self.groups):
            self._check_groups()

    def _check_groups(self) -> None:
        groups, group_of = self.num_groups, {}
        for rid, table in self.by_request.items():
            assert len(table) % groups == 0, f"{rid}: table of {len(table)} entries for {groups} groups"
            for entry, block in enumerate(table):
                group, index = entry % groups, entry // groups
                manager = self.groups[group]
                if block == NULL_BLOCK:
                    assert manager.window, f"{rid}: a hole in global group {group}"
                    continue
                assert group_of.setdefault(block, group) == group, f"block {block} is in two groups"
                assert manager.may_hold(rid, index), f"{rid}: block {block} left group {group}'s window"
