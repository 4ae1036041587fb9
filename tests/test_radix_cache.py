"""RadixCache: prefix matching, insertion, LRU eviction of idle leaves, namespaces, counters."""
from __future__ import annotations

import pytest

from kvpage import BlockPool, NoFreeBlocksError, RadixCache

BS = 4


def make(num_blocks: int = 16):
    pool = BlockPool(num_blocks, BS)
    return pool, RadixCache(pool)


def cache_sequence(pool: BlockPool, cache: RadixCache, tokens, namespace=None, release=True) -> list[int]:
    """Allocate blocks for ``tokens``' full blocks, cache them, optionally drop the holder."""
    blocks = pool.allocate(len(tokens) // BS)
    for b in blocks:
        pool.set_fill(b, BS)
    cache.insert(tokens, blocks, namespace)
    if release:
        pool.free(blocks[::-1])
    return blocks


def test_match_returns_cached_full_blocks_and_tokens_covered():
    pool, cache = make()
    tokens = list(range(10))  # two full blocks + 2 tokens
    blocks = cache_sequence(pool, cache, tokens)
    assert len(blocks) == 2
    assert cache.num_cached_blocks == 2
    m = cache.match_prefix(tokens)
    assert m.block_ids == tuple(blocks) and m.num_tokens == 8
    # Partial overlap: only whole matching blocks count.
    m = cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 7])
    assert m.block_ids == (blocks[0],) and m.num_tokens == 4
    m = cache.match_prefix([0, 1, 2])
    assert m.block_ids == () and m.num_tokens == 0
    m = cache.match_prefix([9, 9, 9, 9])
    assert m.num_tokens == 0
    assert cache.match_prefix(tokens, max_blocks=1).block_ids == (blocks[0],)
    cache.check_integrity()


def test_insert_chunk_by_chunk_extends_the_path():
    pool, cache = make()
    tokens = list(range(12))
    blocks = pool.allocate(3)
    assert cache.insert(tokens, blocks[:1]) == 1
    assert cache.insert(tokens, blocks[:2], start_block=1) == 1
    assert cache.insert(tokens, blocks[:3]) == 1  # a full re-walk adds only the new block
    assert cache.insert(tokens, blocks[:3]) == 0
    assert cache.match_prefix(tokens).block_ids == tuple(blocks)
    with pytest.raises(ValueError):
        cache.insert(tokens[:7], blocks[:2])  # two full blocks need 8 tokens
    cache.check_integrity()


def test_duplicate_insert_keeps_the_first_block_and_stops():
    pool, cache = make()
    tokens = list(range(12))
    first = pool.allocate(1)
    cache.insert(tokens, first)
    dup = pool.allocate(3)
    # The duplicate of block 0 stays uncached, and so does everything after it: hanging it
    # under the other holder's block would leave that block idle-but-unevictable later.
    assert cache.insert(tokens, dup) == 0
    assert not any(pool.is_cached(b) for b in dup)
    pool.free(first)
    assert pool.num_free_blocks == 16 - 3
    assert len(pool.allocate(pool.num_free_blocks)) == 13  # every counted block is obtainable
    cache.check_integrity()


def test_locked_blocks_are_never_evicted():
    pool, cache = make(num_blocks=4)
    tokens = list(range(8))
    blocks = cache_sequence(pool, cache, tokens)
    hit = cache.match_prefix(tokens)
    pool.incref(hit.block_ids)  # lock, as a request admitted with this hit would
    assert pool.num_free_blocks == 2
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert cache.match_prefix(tokens).block_ids == tuple(blocks)
    assert cache.num_evicted_blocks == 0
    cache.check_integrity()


def test_lru_evicts_least_recently_used_leaves_first():
    pool, cache = make(num_blocks=6)
    a = cache_sequence(pool, cache, [1] * 4)
    b = cache_sequence(pool, cache, [2] * 4)
    c = cache_sequence(pool, cache, [3] * 4)
    cache.match_prefix([1] * 4)  # a becomes the most recently used
    pool.allocate(3)  # free stack has 3; no eviction yet
    assert cache.num_evicted_blocks == 0
    pool.allocate(1)
    assert not pool.is_cached(b[0]) and pool.is_cached(a[0]) and pool.is_cached(c[0])
    pool.allocate(1)
    assert not pool.is_cached(c[0]) and pool.is_cached(a[0])
    pool.allocate(1)
    assert cache.num_cached_blocks == 0 and cache.num_evicted_blocks == 3
    cache.check_integrity()


def test_eviction_takes_the_tail_before_the_shared_head():
    pool, cache = make(num_blocks=4)
    # Two sequences sharing block 0; only leaves are evictable, deepest first.
    shared = pool.allocate(1)
    pool.incref(shared)  # held by both sequences
    x, y = pool.allocate(2)
    cache.insert([0] * 4 + [1] * 4, shared + [x])
    cache.insert([0] * 4 + [2] * 4, shared + [y])
    pool.free([x, shared[0]])
    pool.free([y, shared[0]])
    cache.match_prefix([0] * 4 + [2] * 4)  # y's path is newer
    assert pool.num_free_blocks == 4
    pool.allocate(2)  # one free block + one eviction: x (the oldest leaf), never the shared head
    assert not pool.is_cached(x) and pool.is_cached(y) and pool.is_cached(shared[0])
    pool.allocate(1)  # y goes; the head is now a leaf but not needed
    assert pool.is_cached(shared[0]) and not pool.is_cached(y)
    pool.allocate(1)
    assert cache.num_cached_blocks == 0
    cache.check_integrity()


def test_touching_a_queued_leaf_requeues_it_at_its_true_age():
    pool, cache = make(num_blocks=2)
    a = cache_sequence(pool, cache, [1] * 4)
    b = cache_sequence(pool, cache, [2] * 4)
    # Both are queued with their insert stamps; touching ``a`` makes ``b`` the older one.
    cache.match_prefix([1] * 4)
    pool.allocate(1)
    assert pool.is_cached(a[0]) and not pool.is_cached(b[0])


def test_namespaces_are_isolated():
    pool, cache = make()
    tokens = list(range(8))
    cache_sequence(pool, cache, tokens, namespace="tenant-a")
    assert cache.match_prefix(tokens).num_tokens == 0
    assert cache.match_prefix(tokens, namespace="tenant-b").num_tokens == 0
    assert cache.match_prefix(tokens, namespace="tenant-a").num_tokens == 8
    b2 = cache_sequence(pool, cache, tokens, namespace="tenant-b")
    assert cache.match_prefix(tokens, namespace="tenant-b").block_ids == tuple(b2)
    assert cache.num_cached_blocks == 4
    cache.check_integrity()


def test_hit_counters():
    pool, cache = make()
    tokens = list(range(10))
    cache_sequence(pool, cache, tokens)
    assert cache.hit_rate == 0.0
    cache.match_prefix(tokens)  # 10 queried, 8 hit
    cache.match_prefix([7] * 6)  # 6 queried, 0 hit
    cache.match_prefix(tokens, record=False)
    assert cache.num_queried_tokens == 16 and cache.num_hit_tokens == 8
    assert cache.hit_rate == pytest.approx(0.5)
    cache.record_query(4, 4)
    assert (cache.num_queried_tokens, cache.num_hit_tokens) == (20, 12)


def test_reset_clears_idle_blocks_but_not_in_use():
    pool, cache = make()
    held = cache_sequence(pool, cache, list(range(8)), release=False)
    with pytest.raises(ValueError):
        cache.reset()
    pool.free(held[::-1])
    cache.reset()
    assert cache.num_cached_blocks == 0 and pool.num_cached_blocks == 0
    assert pool.num_free_blocks == 16
    cache.check_integrity()


def test_check_integrity_detects_corruption():
    pool, cache = make()
    blocks = cache_sequence(pool, cache, list(range(4)))
    cache._heap.clear()  # the idle leaf is no longer evictable
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache._push(cache._node_of_block[blocks[0]])
    cache.check_integrity()
    pool._num_referenced += 1
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_heap_stays_bounded_without_memory_pressure():
    pool, cache = make(num_blocks=8)
    tokens = list(range(4))
    cache_sequence(pool, cache, tokens)
    for _ in range(2000):  # each hit + release re-queues the idle leaf
        hit = cache.match_prefix(tokens)
        pool.incref(hit.block_ids)
        pool.free(hit.block_ids)
    assert len(cache._heap) <= 2 * cache.num_cached_blocks + 65
    cache.check_integrity()
