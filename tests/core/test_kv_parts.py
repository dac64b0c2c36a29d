"""The KV cache manager's parts on their own, each built from what its constructor takes: a sliding
group's manager, the prefix cache over a bare pool, and the swap space."""

from llmserve.core.attention_managers import FullAttentionManager, SlidingWindowManager
from llmserve.core.block_pool import BlockPool
from llmserve.core.block_tables import NULL_BLOCK
from llmserve.core.prefix_cache import PrefixCache
from llmserve.core.swap_space import SwapSpace

N = NULL_BLOCK


def test_sliding_manager_frees_each_block_once_and_keeps_the_sinks():
    manager = SlidingWindowManager(window=8, block_size=4, num_sink_blocks=1)
    assert manager.max_blocks == 1 + 2 + 1
    assert manager.leaving_window("r", position=12, num_blocks=4) == range(0)  # 12 sees 5..12: block 1 on
    assert manager.leaving_window("r", position=16, num_blocks=5) == range(1, 2)  # 16 sees 9..16
    assert manager.leaving_window("r", position=16, num_blocks=5) == range(0)  # already freed
    assert manager.leaving_window("r", position=24, num_blocks=7) == range(2, 4)
    assert manager.may_hold("r", 0) and not manager.may_hold("r", 3) and manager.may_hold("r", 4)
    manager.fork("r", "child")
    assert not manager.may_hold("child", 3)
    manager.free("r")
    assert manager.may_hold("r", 3)  # forgotten: only the sinks' default start is left


def test_sliding_hit_needs_only_the_last_windows_blocks():
    manager = SlidingWindowManager(window=8, block_size=4)
    cached = {2: 12, 3: 13, 4: 14}  # blocks 0 and 1 evicted
    # a hit of 5 blocks (20 tokens): the query at 20 sees 13..20, blocks 3 and 4
    assert manager.hit_length(5, cached.get) == 5
    assert FullAttentionManager().hit_length(5, cached.get) == 0  # a full group needs block 0 on


def test_prefix_cache_registers_computed_blocks_and_finds_them(make_request):
    pool = BlockPool(8)
    cache = PrefixCache(pool, block_size=4, groups=(FullAttentionManager(),))
    tokens = list(range(100, 110))
    first = make_request(10, tokens=tokens)
    table = pool.allocate(3)
    first.num_computed_tokens = 10
    cache.register(first, table)  # two full blocks; the third holds 2 tokens
    assert pool.num_cached_blocks == 2
    assert cache.longest_hit(make_request(10, tokens=tokens)) == table[:2]
    assert cache.longest_hit(make_request(9, tokens=tokens[:4] + [7] * 5)) == table[:1]


def test_swap_space_round_trip_keeps_the_holes():
    device = BlockPool(8)
    swap = SwapSpace(4, device)
    table = device.allocate(4)
    device.free([table[1]])
    table[1] = N  # left a sliding window
    assert swap.can_take(table)
    assert swap.swap_out("r", table) == [(0, 0), (2, 1), (3, 2)]  # live blocks only
    assert swap.tables == {"r": [0, N, 1, 2]} and device.num_free_blocks == 8
    back, moves = swap.swap_in("r", num_entries=5)  # the device's free queue: 4..7, then 1, 3, 2, 0
    assert back == [4, N, 5, 6, 7] and moves == [(0, 4), (1, 5), (2, 6)]
    assert not swap.holds("r") and swap.pool.num_free_blocks == 4
    swap.check_integrity()
