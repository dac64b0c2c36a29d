"""Which replica serves a request: the longest cached prefix, within a bound on imbalance.

1. Among the healthy replicas not yet tried, find the one holding the most leading blocks of the
   prompt (ties: the less loaded).
2. If it holds at least one and its load (requests in it) exceeds the least loaded replica's by at
   most `max_imbalance`, it serves: the prefix is not computed again.
3. Otherwise the least loaded serves (ties: lower KV-cache usage, then in turn), so unique prompts
   spread evenly and one hot prefix cannot pile more than `max_imbalance` extra requests onto one
   replica: past the bound its requests spill to the others, which then cache the prefix too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from llmserve.router.index import PrefixIndex
from llmserve.router.replica import Replica


@dataclass(frozen=True)
class Choice:
    replica: Replica
    matched_blocks: int  # prompt blocks the replica holds
    by_prefix: bool  # chosen for its cached prefix (else as the least loaded)


class RoutingPolicy:
    def __init__(self, index: PrefixIndex, max_imbalance: int) -> None:
        self.index = index
        self.max_imbalance = max_imbalance
        self._turn = itertools.count()  # breaks load ties in turn

    def choose(self, candidates: Sequence[Replica], hashes: Sequence[bytes]) -> Choice | None:
        """The replica for a prompt with these block hashes; None if there is no candidate."""
        if not candidates:
            return None
        matches = {replica.url: self.index.match(replica.url, hashes) for replica in candidates}
        best = max(candidates, key=lambda replica: (matches[replica.url], -replica.load))
        lightest = min(replica.load for replica in candidates)
        if matches[best.url] and best.load - lightest <= self.max_imbalance:
            return Choice(best, matches[best.url], by_prefix=True)
        least = self._least_loaded(candidates)
        return Choice(least, matches[least.url], by_prefix=False)

    def _least_loaded(self, candidates: Sequence[Replica]) -> Replica:
        lowest = min(candidates, key=lambda replica: (replica.load, replica.kv_cache_usage))
        tied = [r for r in candidates if (r.load, r.kv_cache_usage) == (lowest.load, lowest.kv_cache_usage)]
        return tied[next(self._turn) % len(tied)]
