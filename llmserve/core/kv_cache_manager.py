"""Per-sequence block tables over the shared block pool. No tensors: the scheduler plans with it.

A request's block table maps its logical token positions to physical KV slots:

    positions  0 ..15 | 16..31 | 32..47 | ...
    block ids  [  7   |   2    |   11   | ...]        slot of position p = table[p // B] * B + p % B

Blocks are allocated as tokens arrive (`allocate_slots`) and all returned when the request
finishes, is aborted or is preempted (`free`). Waste is under one block per sequence.
"""

from __future__ import annotations

from llmserve.core.block_pool import BlockPool
from llmserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

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

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones; all or nothing."""
        table = self.block_tables.setdefault(request.request_id, [])
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        table.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.pool.free(reversed(table))

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def check_integrity(self) -> None:
        """Every used block is owned by exactly its ref count of tables; free + used = total."""
        self.pool.check_integrity()
        owners = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for block in table:
                owners[block] += 1
        assert owners == self.pool.ref_counts, "block tables and ref counts disagree"
