"""--check-invariants: a consistent cache passes; a corrupted one is counted and serving goes on."""

from __future__ import annotations

from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.engine.invariants import InvariantChecker
from llmserve.request import Request
from llmserve.sampling_params import SamplingParams


def test_a_leaked_block_is_counted_once_per_check():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    checker = InvariantChecker(manager)
    request = Request("r", list(range(10)), SamplingParams(max_tokens=4), 0.0, 0, (2,))
    assert manager.allocate_slots(request, 10)
    assert checker.check() and checker.violations == 0
    manager.block_tables.by_request.pop("r")  # the table forgets its blocks: they are leaked
    assert not checker.check() and not checker.check()
    assert checker.violations == 2
