"""--check-invariants: the KV cache manager's and block pool's integrity checks after every step (with
KV-cache groups, per group too: a block in one group only, no hole in a global group's table).

A violation is counted (`llmserve:invariant_violations_total` on /metrics) and logged with what
disagreed; serving goes on, so a soak test sees every violation rather than the first.
"""

from __future__ import annotations

import logging

from llmserve.core.kv_cache_manager import KVCacheManager

logger = logging.getLogger("llmserve")


class InvariantChecker:
    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.violations = 0

    def check(self) -> bool:
        """Run the checks; False (counted and logged) when one fails."""
        try:
            self.kv_cache_manager.check_integrity()
        except AssertionError as error:
            self.violations += 1
            logger.error("KV cache invariant violated after a step: %s", error)
            return False
        return True
