"""Which block hashes each replica's prefix cache holds, as its KV events tell.

Per replica a set of hashes, changed by BlockStored, BlockRemoved and AllBlocksCleared events
(core/kv_events.py) in the order the replica published them; replaying them gives the replica's
cache index exactly. Since a block's hash covers its whole prefix, the number of a prompt's leading
block hashes found in a replica's set is the number of its blocks that replica would not recompute.

Between routing a prompt and its BlockStored event lie a prefill and a network hop; a second request
with the same prefix in that window should follow the first. So the router also notes the hashes of
each prompt it routes as pending on that replica, for `pending_seconds` or until the events confirm
them. The event-subscriber thread and the event loop share the index: every method takes the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from llmserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

_MIN_PRUNE_SIZE = 4096


class PrefixIndex:
    def __init__(self, replicas: Sequence[str], pending_seconds: float = 10.0) -> None:
        self.pending_seconds = pending_seconds
        self._lock = threading.Lock()
        self._stored: dict[str, set[bytes]] = {name: set() for name in replicas}
        self._pending: dict[str, dict[bytes, float]] = {name: {} for name in replicas}  # hash -> expiry
        self.num_events = dict.fromkeys(replicas, 0)
        self._prune_at = dict.fromkeys(replicas, _MIN_PRUNE_SIZE)  # pending size that triggers a sweep

    def apply(self, replica: str, batch: KVEventBatch) -> None:
        with self._lock:
            stored, pending = self._stored[replica], self._pending[replica]
            for event in batch.events:
                if isinstance(event, BlockStored):
                    stored.update(event.block_hashes)
                    for block_hash in event.block_hashes:
                        pending.pop(block_hash, None)
                elif isinstance(event, BlockRemoved):
                    stored.difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    stored.clear()
            self.num_events[replica] += len(batch.events)

    def clear(self, replica: str) -> None:
        """Forget what the replica holds (it restarted, or events were lost that replay cannot fill)."""
        with self._lock:
            self._stored[replica].clear()
            self._pending[replica].clear()

    def note_routed(self, replica: str, hashes: Sequence[bytes], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            stored, pending = self._stored[replica], self._pending[replica]
            for block_hash in hashes:
                if block_hash not in stored:
                    pending[block_hash] = now + self.pending_seconds
            if len(pending) > self._prune_at[replica]:  # expired entries no prompt looked up again
                for block_hash in [h for h, expiry in pending.items() if expiry <= now]:
                    del pending[block_hash]
                self._prune_at[replica] = max(_MIN_PRUNE_SIZE, 2 * len(pending))

    def match(self, replica: str, hashes: Sequence[bytes], now: float | None = None) -> int:
        """How many of `hashes` (a prompt's chained block hashes) the replica holds, from the first on."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stored, pending = self._stored[replica], self._pending[replica]
            for count, block_hash in enumerate(hashes):
                if block_hash not in stored and pending.get(block_hash, 0.0) <= now:
                    pending.pop(block_hash, None)
                    return count
            return len(hashes)

    def num_pending(self, replica: str) -> int:
        with self._lock:
            return len(self._pending[replica])

    def stored(self, replica: str) -> set[bytes]:
        """A copy of the replica's confirmed hashes (tests compare it with the engine's cache)."""
        with self._lock:
            return set(self._stored[replica])
