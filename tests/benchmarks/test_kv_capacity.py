"""The KV capacity figure in docs/models.md is the cache manager's own count: for each length, the
blocks the tool computes per group equal the blocks a decoding sequence holds in a KVCacheManager."""

import pytest

from benchmarks.tools.kv_capacity import capacity, sequence_blocks
from llmserve.config.kv_groups import kv_cache_groups
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.request import Request
from llmserve.sampling_params import SamplingParams

TYPES = ("sliding_attention",) * 5 + ("full_attention",)  # Gemma 3's pattern, one block per layer


@pytest.mark.parametrize("length", [1, 7, 8, 9, 31, 64, 100])
def test_tool_counts_the_blocks_the_manager_holds(length):
    window, block = 10, 4
    groups = kv_cache_groups(TYPES, window)
    kv = KVCacheManager(
        512, block, enable_prefix_caching=False, group_windows=tuple(g.window for g in groups)
    )
    request = Request("r", [5] * length, SamplingParams(max_tokens=1))
    assert kv.allocate_slots(request, 1)
    for computed in range(1, length):  # decode one token at a time up to the query at length - 1
        request.num_computed_tokens = computed
        assert kv.allocate_slots(request, 1)
    for index, group in enumerate(groups):
        held = [b for b in kv.block_tables.group("r", index) if b >= 0]
        assert len(held) == sequence_blocks(length, group.window, block)
    figure = capacity(TYPES, window, block, length)
    assert figure["layer_blocks_bounded"] == kv.pool.num_blocks - kv.pool.num_free_blocks  # 1 layer a block
    assert figure["layer_blocks_full"] == 6 * -(-length // block)
