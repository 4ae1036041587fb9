"""Hybrid KV groups in the core: grouping, window release, the prefix-hit rule, accounting."""
from __future__ import annotations

import pytest

from kvpage import CacheConfig, SamplingParams, Scheduler, SchedulerConfig
from kvpage.core.kv.block_pool import BlockPool
from kvpage.core.kv.kv_groups import KVCacheGroups, plan_kv_groups
from kvpage.core.kv.radix_cache import RadixCache

GEMMA3 = [8, 8, 8, 8, 8, None]  # five sliding layers of window 8, then one full layer


def test_gemma3_pattern_groups_one_layer_each_full_first():
    groups = plan_kv_groups(GEMMA3 * 2)
    assert groups.is_hybrid and groups.group_size == 2
    assert groups.windows == (None, 8, 8, 8, 8, 8)
    assert groups.groups[0].layers == (5, 11)
    assert sorted(layer for g in groups.groups for layer in g.layers) == list(range(12))
    assert groups.position_of_layer(11) == (0, 1) and groups.position_of_layer(0) == (1, 0)


def test_uneven_counts_pad_the_last_group():
    # Gemma3-1B: 26 layers, full attention every sixth -> 4 full, 22 sliding.
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    groups = plan_kv_groups(windows)
    assert groups.group_size == 4
    assert [len(g.layers) for g in groups.groups] == [4, 4, 4, 4, 4, 4, 2]


def test_near_equal_counts_make_one_group_per_kind():
    groups = plan_kv_groups([None, 16] * 4 + [16])  # 4 full, 5 sliding
    assert groups.group_size == 5 and groups.num_groups == 2


@pytest.mark.parametrize("windows, hybrid, reason", [
    ([None, None], True, "same attention kind"),
    ([8, 16, 8], True, "no layer has full attention"),
    ([8, None], False, "disabled"),
])
def test_single_group_fallbacks_say_why(windows, hybrid, reason):
    groups = plan_kv_groups(windows, hybrid)
    assert not groups.is_hybrid and groups.num_groups == 1 and reason in groups.reason
    assert groups.groups[0].layers == tuple(range(len(windows)))


def test_blocks_per_request_arithmetic():
    groups = plan_kv_groups([1024] * 5 + [None])
    # 8k context, block 16: the full layer keeps 512 blocks, each sliding one 65 at most.
    assert groups.blocks_per_request(8192, 16) == 512 + 5 * 65
    single = KVCacheGroups.single(6)
    assert single.blocks_per_request(8192, 16) == 512  # one group of 6 layers per block
    # A prefill chunk writes all its tokens before attending: its window grows for the step.
    assert groups.groups[1].blocks_held(8192, 16, chunk_tokens=2048) == -(-(1023 + 2048) // 16) + 1


def _scheduler(num_blocks=64, windows=(None, 8), budget=64, prefix=True):
    return Scheduler(CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=prefix,
                                 group_windows=windows),
                     SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=128))


def _run_to_end(s: Scheduler, token: int = 3) -> list:
    trace = []
    while s.has_unfinished_requests():
        out = s.schedule()
        trace.append(out)
        s.update_from_output(out, [token] * out.metadata.num_sampled_rows)
        s.check_integrity()
    return trace


def test_sliding_group_releases_blocks_behind_the_window():
    s = _scheduler()
    r = s.make_request("a", list(range(1, 41)), SamplingParams(max_tokens=6, ignore_eos=True))
    out = s.schedule()  # the whole 40-token prompt in one step: 10 blocks in each group
    assert len(r.block_tables[1]) == 10 and r.released_blocks[1] == 0
    s.update_from_output(out, [3])
    # Next query at 40 reads keys > 32: blocks 8 and 9 stay, 0..7 went back to the pool.
    assert r.released_blocks[1] == 8 and r.held_blocks(1) == r.block_tables[1][8:]
    assert r.block_tables[1][:8] == [0] * 8 and len(r.block_ids) == 10
    s.check_integrity()
    for _ in range(5):
        out = s.schedule()
        meta = out.metadata
        assert meta.num_groups == 2 and meta.for_group(1).block_tables[0, :r.released_blocks[1]].tolist() == \
            [0] * r.released_blocks[1]
        s.update_from_output(out, [3])
        assert len(r.held_blocks(1)) <= 3
        s.check_integrity()
    assert not s.has_unfinished_requests()
    stats = s.stats()["kv_groups"]
    assert [g["sliding_window"] for g in stats] == [None, 8] and stats[0]["num_used_blocks"] == 0
    assert s.pool.num_free_blocks == s.pool.num_blocks


def test_released_cached_blocks_stay_evictable_and_accounted():
    s = _scheduler(num_blocks=40, budget=16)
    s.make_request("a", list(range(1, 41)), SamplingParams(max_tokens=1))
    _run_to_end(s)
    pool = s.pool
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    assert pool.num_cached_blocks == 20  # 10 full blocks, each with its sliding block
    # A newcomer needing most of the pool evicts cached blocks (sliding ones anywhere).
    s.make_request("b", [90 + i % 5 for i in range(100)], SamplingParams(max_tokens=1))
    _run_to_end(s)
    assert pool.num_free_blocks == pool.num_blocks


def _cache_with_path(windows=(None, 8), num_blocks=32, length=40):
    """A radix cache holding one 10-block path whose group-0 blocks stay held by a fake holder."""
    pool = BlockPool(num_blocks, 4, len(windows))
    cache = RadixCache(pool, windows=windows)
    tokens = list(range(1, length + 1))
    full = pool.allocate(length // 4, 0)
    sliding = pool.allocate(length // 4, 1)
    assert cache.insert(tokens, full, group_tables=[sliding]) == length // 4
    return pool, cache, tokens, full, sliding


def test_hit_needs_the_window_before_its_end():
    pool, cache, tokens, full, sliding = _cache_with_path()
    query = tokens + [99] * 4
    hit = cache.match_prefix(query)
    assert hit.num_tokens == 40 and hit.group_blocks == ((8, tuple(sliding[8:10])),)
    pool.free(sliding[:6])  # released behind the window: cached-idle, evictable
    assert cache.evict(6) == 6  # group 0 is held, so only the sliding blocks can go
    assert cache.match_prefix(query).num_tokens == 40  # blocks 8, 9 are still there
    pool.free([sliding[8]])
    cache.evict(1)
    # k = 10 needs sliding blocks 8, 9; k = 9 needs 7, 8; k = 8 needs 6, 7: present.
    hit = cache.match_prefix(query)
    assert hit.num_tokens == 32 and hit.block_ids == tuple(full[:8]) and hit.group_blocks == ((6, tuple(sliding[6:8])),)
    pool.free([sliding[6]])
    cache.evict(1)
    # Every window before the path's end now has a hole: no hit at all.
    assert cache.match_prefix(query).num_tokens == 0
    cache.check_integrity()


def test_evicting_a_node_takes_its_group_blocks():
    pool, cache, tokens, full, sliding = _cache_with_path()
    pool.free(full[::-1])
    pool.free(sliding[::-1])
    assert pool.num_free_blocks == pool.num_blocks
    released = cache.evict(3)
    assert released >= 3 and pool.num_cached_blocks == 20 - released
    cache.check_integrity()
    cache.reset()
    assert pool.num_cached_blocks == 0
    pool.check_integrity()


def test_prefix_hit_takes_only_the_window_and_output_matches_cached_prefix():
    s = _scheduler(num_blocks=60)
    prompt = list(range(1, 41))
    s.make_request("a", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    _run_to_end(s)
    b = s.make_request("b", prompt + [7, 7, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    out = s.schedule()
    assert b.num_cached_tokens == 40 and out.num_new_tokens == [3]
    # The hit took group 0's ten blocks and group 1's window (blocks 8, 9) only.
    assert b.released_blocks[1] == 8 and len(b.held_blocks(1)) == 3
    s.update_from_output(out, [3])
    s.check_integrity()
    _run_to_end(s)


def test_fork_and_copy_on_write_cover_every_group():
    s = _scheduler()
    parent = s.make_request("p", list(range(1, 11)), SamplingParams(max_tokens=8, ignore_eos=True))
    out = s.schedule()
    s.update_from_output(out, [3])
    child = s.fork_request("p", "c")
    assert child.block_tables == parent.block_tables and child.released_blocks == parent.released_blocks
    out = s.schedule()
    # Both append into the shared partial block: one copy per group for the first of them.
    assert len(out.metadata.block_copies) == 2
    s.update_from_output(out, [3, 4])
    s.check_integrity()
    _run_to_end(s)
    assert s.pool.num_free_blocks == s.pool.num_blocks


def test_request_too_long_for_the_pool_names_the_numbers():
    s = _scheduler(num_blocks=12)
    with pytest.raises(ValueError, match="blocks"):
        s.make_request("x", list(range(1, 60)), SamplingParams(max_tokens=4))


def test_tiers_need_a_single_group():
    with pytest.raises(ValueError, match="single KV group"):
        CacheConfig(block_size=4, num_blocks=8, num_host_blocks=8, group_windows=(None, 8))
    with pytest.raises(ValueError, match="full-attention"):
        CacheConfig(block_size=4, num_blocks=8, group_windows=(8, None))


def test_recomputing_a_prefix_refills_its_evicted_window():
    """A prefix whose sliding blocks were evicted while its full blocks stayed held: a request
    recomputing it adopts its own sliding blocks into the existing nodes, so the next request
    hits again; evicting those nodes later leaves the adopter's blocks to the adopter."""
    pool, cache, tokens, full, sliding = _cache_with_path()
    query = tokens + [99] * 4
    pool.free(sliding)  # holder A moved on: its window blocks went idle...
    cache.evict(10)  # ...and were evicted; A still holds the full blocks
    assert cache.match_prefix(query).num_tokens == 0
    b_full, b_sliding = pool.allocate(10, 0), pool.allocate(10, 1)
    # B inserts in two chunks, the second resuming along A's nodes.
    assert cache.insert(tokens[:24], b_full[:6], group_tables=[b_sliding[:6]]) == 0
    assert cache.insert(tokens, b_full, start_block=6, group_tables=[b_sliding]) == 0  # no new nodes
    hit = cache.match_prefix(query)
    assert hit.num_tokens == 40 and hit.block_ids == tuple(full) and hit.group_blocks == ((8, tuple(b_sliding[8:])),)
    cache.check_integrity()
    pool.free(full[::-1])  # A ends: its nodes can go, B's adopted blocks stay B's
    assert cache.evict(100) == 10
    assert pool.num_cached_blocks == 0 and pool.num_used_blocks == 20
    cache.check_integrity()
    pool.free(b_full + b_sliding)
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_integrity()
