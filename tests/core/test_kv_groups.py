"""KV-cache groups (sliding and global layers, one block table each): the layer split, exact block
ids of an interleaved table, a sliding group's blocks bounded by its window while a global group's
grow, prefix-cache hits that need only the last window's blocks, draft rollback, and the per-group
integrity checks."""

import pytest

from llmserve.config.kv_groups import KVCacheGroup, group_size, kv_cache_groups
from llmserve.core.kv_cache_manager import NULL_BLOCK, KVCacheManager, cdiv

N = NULL_BLOCK
S, F = "sliding_attention", "full_attention"


def test_layers_split_into_groups_of_equal_size_global_first():
    assert kv_cache_groups((S, F, S, F), 16) == (KVCacheGroup(0, (1, 3)), KVCacheGroup(16, (0, 2)))
    gemma3 = kv_cache_groups((S, S, S, S, S, F) * 2, 8)  # 10 sliding, 2 global: 5 sliding groups of 2
    assert gemma3 == (KVCacheGroup(0, (5, 11)),) + tuple(
        KVCacheGroup(8, pair) for pair in ((0, 1), (2, 3), (4, 6), (7, 8), (9, 10))
    )
    assert group_size(gemma3) == 2
    odd = kv_cache_groups((S, F, S, S, F), 4)  # 3 sliding over groups of 2: the last one shorter
    assert odd == (KVCacheGroup(0, (1, 4)), KVCacheGroup(4, (0, 2)), KVCacheGroup(4, (3,)))
    assert group_size(odd, [range(0, 2), range(2, 5)]) == 1  # per pipeline stage: at most one per group


def hybrid(num_blocks=64, window=8, prefix_caching=False):
    return KVCacheManager(num_blocks, 4, enable_prefix_caching=prefix_caching, group_windows=(0, window))


def test_interleaved_table_frees_the_sliding_groups_blocks_as_they_leave_the_window(make_request):
    kv = hybrid()
    request = make_request(10)
    assert kv.allocate_slots(request, 10)
    assert kv.get_block_table(request.request_id) == [0, 1, 2, 3, 4, 5]
    assert kv.block_tables.group(request.request_id, 0) == [0, 2, 4]
    assert kv.block_tables.group(request.request_id, 1) == [1, 3, 5]
    request.num_computed_tokens = 12  # next query at 12 sees 5..12: block 0 of the sliding group goes
    assert kv.allocate_slots(request, 1)
    assert kv.get_block_table(request.request_id) == [0, N, 2, 3, 4, 5, 6, 7]
    assert kv.block_tables.num_window_evicted_blocks == 1 and kv.pool.num_free_blocks == 64 - 7
    kv.check_integrity()
    assert request.request_id in kv.take_rewritten_tables()


def test_sliding_group_stays_bounded_while_the_global_group_grows(make_request):
    kv = hybrid(num_blocks=256, window=10)
    bound = cdiv(10, 4) + 1
    request = make_request(7)
    assert kv.allocate_slots(request, 7)
    request.num_computed_tokens, peak = 7, 0
    for computed in range(7, 200):
        request.num_computed_tokens = computed
        assert kv.allocate_slots(request, 1)
        live = [b for b in kv.block_tables.group(request.request_id, 1) if b != N]
        assert len(live) <= bound == kv.groups[1].max_blocks
        peak = max(peak, len(live))
        assert len(kv.block_tables.group(request.request_id, 0)) == cdiv(computed + 1, 4)
        kv.check_integrity()
    assert peak == bound  # reached, not only bounded
    assert kv.pool.num_blocks - kv.pool.num_free_blocks == cdiv(200, 4) + len(live)


def _computed_request(kv, make_request, tokens):
    request = make_request(len(tokens), tokens=tokens)
    assert kv.allocate_slots(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(request)
    kv.free(request)
    kv.forget(request)


def test_prefix_hit_needs_only_the_last_window_of_the_sliding_group(make_request):
    kv = hybrid(prefix_caching=True)
    tokens = list(range(100, 140))  # 10 full blocks: flat entries 0..19
    _computed_request(kv, make_request, tokens)
    again = make_request(41, tokens=tokens + [7])
    hit = kv.get_computed_blocks(again)
    # the query at 40 sees 33..40 (window 8): the sliding group needs its blocks 8 and 9 only
    assert hit[0::2] == list(range(0, 20, 2))
    assert hit[1::2] == [N] * 8 + [17, 19]
    assert kv.num_cached_tokens(hit) == 40
    assert kv.allocate_slots(again, 1, hit)
    again.num_computed_tokens = 40
    assert kv.pool.ref_counts[17] == kv.pool.ref_counts[19] == 1 and kv.pool.ref_counts[1] == 0
    kv.check_integrity()


def test_prefix_hit_shrinks_until_every_group_has_it(make_request):
    kv = hybrid(prefix_caching=True)
    tokens = list(range(100, 140))
    _computed_request(kv, make_request, tokens)
    kv.pool.allocate(44 + 1)  # the free queue: 20..63, then the request's blocks last-first (19 first)
    assert not kv.pool.is_cached(19) and kv.pool.is_cached(18)  # sliding block 9 evicted
    hit = kv.get_computed_blocks(make_request(41, tokens=tokens + [7]))
    # 9 blocks: the global group has them, and the sliding group has its last window's (7 and 8)
    assert kv.num_cached_tokens(hit) == 36
    assert hit[0::2] == list(range(0, 18, 2)) and hit[1::2] == [N] * 7 + [15, 17]


def test_rejected_drafts_roll_back_in_every_group(make_request):
    kv = hybrid()
    request = make_request(10)
    assert kv.allocate_slots(request, 10)
    request.num_computed_tokens = 10
    assert kv.allocate_slots(request, 1 + 3)  # the new token and 3 drafts: 14 tokens, 4 blocks each
    assert len(kv.get_block_table(request.request_id)) == 8
    request.num_computed_tokens = 11  # all drafts rejected
    kv.free_excess_blocks(request)
    assert kv.get_block_table(request.request_id) == [0, 1, 2, 3, 4, 5]
    assert kv.pool.num_free_blocks == 64 - 6
    kv.check_integrity()


def test_integrity_check_finds_a_block_in_two_groups(make_request):
    kv = hybrid()
    first, second = make_request(4), make_request(4)
    assert kv.allocate_slots(first, 4) and kv.allocate_slots(second, 4)
    global_block = kv.block_tables.group(first.request_id, 0)[0]
    table = kv.get_block_table(second.request_id)
    kv.pool.free([table[1]])
    table[1] = global_block  # the second request's sliding entry points at a global block
    kv.pool.incref([global_block])
    with pytest.raises(AssertionError, match="in two groups"):
        kv.check_integrity()


def test_integrity_check_finds_a_hole_in_a_global_group(make_request):
    kv = hybrid()
    request = make_request(8)
    assert kv.allocate_slots(request, 8)
    table = kv.get_block_table(request.request_id)
    kv.pool.free([table[0]])
    table[0] = N
    with pytest.raises(AssertionError, match="hole in global group 0"):
        kv.check_integrity()
