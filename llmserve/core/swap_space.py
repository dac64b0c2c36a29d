"""CPU swap space: a preempted request's blocks move here and come back, instead of being recomputed.

A swapped table keeps the holes of a sliding window (NULL_BLOCK entries): only live blocks move.

    device table  [ 7 | NULL | 11 | 4 ]   --swap out-->   swapped table [ 0 | NULL | 1 | 2 ]
    moves (device, swap): (7, 0) (11, 1) (4, 2); the model runner copies them before the step
"""

from __future__ import annotations

from llmserve.core.block_pool import BlockPool
from llmserve.core.block_tables import NULL_BLOCK, live


class SwapSpace:
    def __init__(self, num_blocks: int, device_pool: BlockPool) -> None:
        self.device_pool = device_pool
        # a pool without a prefix cache hands out the blocks freed last (core/block_pool.py)
        self.pool = BlockPool(num_blocks, reuse_latest=True) if num_blocks else None
        self.tables: dict[str, list[int]] = {}  # request id -> its blocks in the swap space

    @property
    def usage(self) -> float:
        """Fraction of the swap space's blocks in use (0 without one)."""
        return self.pool.usage if self.pool is not None else 0.0

    def holds(self, request_id: str) -> bool:
        return request_id in self.tables

    def can_take(self, table: list[int]) -> bool:
        """Whether the table's live blocks (at least one) fit in the free swap blocks."""
        num_live = len(live(table))
        return self.pool is not None and 0 < num_live <= self.pool.num_free_blocks

    def swap_out(self, request_id: str, table: list[int]) -> list[tuple[int, int]]:
        """Move the table's blocks here and free them on the device; (device block, swap block) copies."""
        device_blocks = live(table)
        swap_blocks = iter(self.pool.allocate(len(device_blocks)))
        swapped = [NULL_BLOCK if block == NULL_BLOCK else next(swap_blocks) for block in table]
        self.tables[request_id] = swapped
        self.device_pool.free(reversed(device_blocks))
        return list(zip(device_blocks, live(swapped), strict=True))

    def swap_in(self, request_id: str, num_entries: int) -> tuple[list[int], list[tuple[int, int]]] | None:
        """Bring the request's blocks back into a device table of `num_entries` entries (the extra
        ones new blocks); that table and the (swap block, device block) copies, or None (and nothing
        changed) if the device pool lacks the blocks."""
        swapped = self.tables[request_id]
        num_freed = len(swapped) - len(live(swapped))  # left a sliding window before the swap
        total = num_entries - num_freed
        if total > self.device_pool.num_free_blocks:
            return None
        device_blocks = iter(self.device_pool.allocate(total))
        table = [NULL_BLOCK if block == NULL_BLOCK else next(device_blocks) for block in swapped]
        del self.tables[request_id]
        self.pool.free(live(swapped))
        return table + list(device_blocks), list(zip(live(swapped), live(table), strict=True))

    def free(self, request_id: str) -> None:
        """Drop a swapped request (aborted before it came back)."""
        swapped = self.tables.pop(request_id, None)
        if swapped:
            self.pool.free(live(swapped))

    def check_integrity(self) -> None:
        """Raise AssertionError unless each swap block is owned by exactly its ref count of tables."""
        if self.pool is None:
            return
        self.pool.check_integrity()
        owners = [0] * self.pool.num_blocks
        for table in self.tables.values():
            for block in live(table):
                owners[block] += 1
        assert owners == self.pool.ref_counts, "swap tables and ref counts disagree"
