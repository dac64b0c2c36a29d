"""One manager per KV-cache group, by the attention kind of its layers (config/kv_groups.py).

A manager holds what differs between kinds: which blocks of a prefix-cache hit the group needs,
which blocks leave the group's window as a request advances, and the per-request state that takes
(for a sliding window, the first logical block not yet freed). The block tables themselves stay
with core/block_tables.py, which asks each group's manager before it frees an entry.

    full attention       every block is read again by every later query: nothing is freed
    sliding window W     a query at position p reads the sinks and (p - W, p]: earlier blocks go
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from llmserve.core.block_tables import cdiv

Lookup = Callable[[int], int | None]  # logical block index -> the cached block of this group, or None


class GroupManager(ABC):
    """The contract of a group's manager. The defaults suit a kind that keeps no per-request state
    and frees nothing before the request ends."""

    window = 0  # positions a query sees back (0: all of them)
    max_blocks: int | None = None  # blocks a decoding sequence holds at most (None: unbounded)

    @abstractmethod
    def hit_length(self, limit: int, lookup: Lookup) -> int:
        """The most leading blocks (at most `limit`) this group can adopt from the prefix cache."""

    @abstractmethod
    def first_visible_block(self, position: int) -> int:
        """The first block a query at `position` reads (sinks aside)."""

    @abstractmethod
    def blocks_wanted(self, num_blocks: int) -> int:
        """Blocks the group holds for a sequence of `num_blocks` logical blocks."""

    def leaving_window(self, request_id: str, position: int, num_blocks: int) -> range:
        """Logical blocks (below `num_blocks`) that no query from `position` on reads, not yet freed;
        they count as freed from now on."""
        return range(0)

    def may_hold(self, request_id: str, index: int) -> bool:
        """Whether logical block `index` of the request may still hold a block (integrity check)."""
        return True

    def adopt_hit(self, request_id: str, num_blocks: int) -> None:
        """The request starts from a prefix-cache hit of `num_blocks` logical blocks."""
        return None  # no per-request state

    def fork(self, source_id: str, child_id: str) -> None:
        """The child shares the source's blocks (parallel samples of one prompt)."""
        return None  # no per-request state

    def free(self, request_id: str) -> None:
        """The request's blocks went back to the pool."""
        return None  # no per-request state


class FullAttentionManager(GroupManager):
    """Layers that see every earlier token: a hit is a leading run of cached blocks, and every block
    stays until the request ends."""

    def hit_length(self, limit: int, lookup: Lookup) -> int:
        return next((index for index in range(limit) if lookup(index) is None), limit)

    def first_visible_block(self, position: int) -> int:
        return 0

    def blocks_wanted(self, num_blocks: int) -> int:
        return num_blocks


class SlidingWindowManager(GroupManager):
    """Layers that see only the first `sinks` positions and the last `window` (StreamingLLM): a
    hit needs only the last window's blocks, and blocks between the sinks and the window are freed."""

    def __init__(self, window: int, block_size: int, num_sink_blocks: int = 0) -> None:
        self.window = window
        self.block_size = block_size
        self.num_sink_blocks = num_sink_blocks
        self.max_blocks = num_sink_blocks + cdiv(window, block_size) + 1  # sinks, window, one partial
        self._start: dict[str, int] = {}  # request id -> first logical block not yet freed by the window

    def hit_length(self, limit: int, lookup: Lookup) -> int:
        """The longest hit (at most `limit` blocks) whose last window's blocks are all cached."""
        end = limit  # candidate hit: blocks [first visible, end) must be cached
        for index in range(limit - 1, -1, -1):
            if lookup(index) is None:
                end = index
            elif index <= self.first_visible_block(end * self.block_size):
                return end
        return 0

    def first_visible_block(self, position: int) -> int:
        return max(position - self.window + 1, 0) // self.block_size

    def blocks_wanted(self, num_blocks: int) -> int:
        return min(num_blocks, self.max_blocks)

    def leaving_window(self, request_id: str, position: int, num_blocks: int) -> range:
        start = self._start.setdefault(request_id, self.num_sink_blocks)
        end = min(self.first_visible_block(position), num_blocks)
        if end <= start:
            return range(0)
        self._start[request_id] = end
        return range(start, end)

    def may_hold(self, request_id: str, index: int) -> bool:
        return index < self.num_sink_blocks or index >= self._start.get(request_id, self.num_sink_blocks)

    def adopt_hit(self, request_id: str, num_blocks: int) -> None:
        self._start[request_id] = self.first_visible_block(num_blocks * self.block_size)

    def fork(self, source_id: str, child_id: str) -> None:
        if source_id in self._start:
            self._start[child_id] = self._start[source_id]

    def free(self, request_id: str) -> None:
        self._start.pop(request_id, None)


def attention_managers(
    windows: tuple[int, ...], block_size: int, num_sink_blocks: int = 0
) -> tuple[GroupManager, ...]:
    """A manager per group, from each group's window (0: full attention)."""
    return tuple(
        SlidingWindowManager(window, block_size, num_sink_blocks) if window else FullAttentionManager()
        for window in windows
    )
