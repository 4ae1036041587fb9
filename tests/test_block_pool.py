"""BlockPool: O(1) alloc/free, ref counts, cached-idle blocks, counters."""
from __future__ import annotations

import numpy as np
import pytest

from kvpage import BlockPool, NoFreeBlocksError, RadixCache


def test_allocate_hands_out_distinct_blocks_with_one_holder():
    pool = BlockPool(8, 4)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    assert all(pool.ref_count(b) == 1 and pool.fill(b) == 0 for b in blocks)
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_free_returns_blocks_and_they_are_reused_lifo():
    pool = BlockPool(4, 4)
    a = pool.allocate(2)
    pool.free(a[::-1])
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    # The last block freed is the first handed out again (stack: no scan).
    assert pool.allocate(1) == [a[0]]
    pool.check_integrity()


def test_exhaustion_raises_and_changes_nothing():
    pool = BlockPool(4, 4)
    held = pool.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1 and [pool.ref_count(b) for b in held] == [1, 1, 1]
    assert not pool.can_allocate(2) and pool.can_allocate(1)
    assert len(pool.allocate(1)) == 1
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_integrity()


def test_negative_allocation_is_rejected():
    with pytest.raises(ValueError):
        BlockPool(4, 4).allocate(-1)


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 4)])
def test_bad_shape_rejected(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_ref_counts_incref_and_free():
    pool = BlockPool(4, 4)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.incref([b])
    assert pool.ref_count(b) == 3
    pool.free([b])
    pool.free([b])
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 3
    pool.free([b])
    assert pool.ref_count(b) == 0 and pool.num_free_blocks == 4
    pool.check_integrity()


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(4, 4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match="double free"):
        pool.free([a])
    # A list freeing one block more often than it is held fails as a whole.
    with pytest.raises(ValueError, match="double free"):
        pool.free([b, b])
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 3
    pool.check_integrity()


@pytest.mark.parametrize("bad", [-1, 4, 100, 1.0, "0", True, None])
def test_unknown_block_raises(bad):
    pool = BlockPool(4, 4)
    pool.allocate(4)
    with pytest.raises(ValueError, match="unknown block"):
        pool.free([bad])
    with pytest.raises(ValueError, match="unknown block"):
        pool.ref_count(bad)
    with pytest.raises(ValueError, match="unknown block"):
        pool.incref([bad])
    with pytest.raises(ValueError, match="unknown block"):
        pool.set_fill(bad, 1)
    assert pool.num_used_blocks == 4


def test_numpy_block_ids_accepted():
    pool = BlockPool(4, 4)
    pool.allocate(2)
    pool.free([np.int64(1)])
    assert pool.ref_count(1) == 0


def test_incref_of_free_block_raises_and_changes_nothing():
    pool = BlockPool(4, 4)
    a, b = pool.allocate(2)
    pool.free([b])
    with pytest.raises(ValueError, match="free"):
        pool.incref([a, b])
    assert pool.ref_count(a) == 1  # the valid block of the failed call gained nothing
    pool.check_integrity()


def test_alloc_and_free_are_constant_time():
    """The free stack makes alloc/free independent of the pool size (no list scans)."""
    import timeit

    def cost(num_blocks: int) -> float:
        pool = BlockPool(num_blocks, 16)
        pool.allocate(num_blocks // 2)  # a half-full pool

        def cycle():
            b = pool.allocate(1)
            pool.free(b)

        return min(timeit.repeat(cycle, number=2000, repeat=5))

    small, large = cost(64), cost(262_144)
    assert large < small * 4, (small, large)  # O(n) would be ~4000x slower


def test_usage_and_fragmentation():
    pool = BlockPool(10, 4)
    assert pool.usage == 0.0 and pool.fragmentation == 0.0
    a, b = pool.allocate(2)
    pool.set_fill(a, 4)
    pool.set_fill(b, 1)
    assert pool.usage == pytest.approx(0.2)
    # 8 slots referenced, 5 hold a token.
    assert pool.fragmentation == pytest.approx(3 / 8)
    pool.raise_fill(b, 3)
    pool.raise_fill(b, 2)  # never lowers
    assert pool.fill(b) == 3 and pool.fragmentation == pytest.approx(1 / 8)
    pool.free([b])
    assert pool.usage == pytest.approx(0.1) and pool.fragmentation == 0.0
    with pytest.raises(ValueError):
        pool.set_fill(a, 5)
    with pytest.raises(ValueError):
        pool.raise_fill(a, 5)
    pool.check_integrity()


def test_cached_idle_blocks_count_as_free_and_are_evicted_on_demand():
    pool = BlockPool(4, 2)
    cache = RadixCache(pool)
    blocks = pool.allocate(2)
    for b in blocks:
        pool.set_fill(b, 2)
    assert cache.insert([1, 2, 3, 4], blocks) == 2
    pool.free(blocks[::-1])
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0 and pool.num_cached_blocks == 2
    assert pool.is_cached(blocks[0]) and pool.ref_count(blocks[0]) == 0
    # Two truly free blocks first; the next allocation must evict.
    fresh = pool.allocate(3)
    assert cache.num_evicted_blocks == 1
    assert pool.num_cached_blocks == 1 and pool.num_free_blocks == 1
    assert all(pool.fill(b) == 0 for b in fresh)
    cache.check_integrity()


def test_mark_and_release_cached_contracts():
    pool = BlockPool(4, 2)
    (b,) = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.release_cached(b)  # not cached
    pool.mark_cached(b)
    with pytest.raises(ValueError):
        pool.release_cached(b)  # in use
    with pytest.raises(ValueError):
        pool.mark_cached(3)  # free blocks cannot be cached


def test_free_stack_holds_every_block_once():
    rng = np.random.default_rng(7)
    pool = BlockPool(32, 4)
    held: list[int] = []
    for _ in range(500):
        if held and rng.random() < 0.5:
            pool.free([held.pop(int(rng.integers(len(held))))])
        elif pool.num_free_blocks:
            held += pool.allocate(int(rng.integers(1, pool.num_free_blocks + 1)))
        pool.check_integrity()
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert len(set(held)) == len(held)


@pytest.mark.parametrize("call, match", [
    (lambda: BlockPool("8", 16), "must be integers"),
    (lambda: BlockPool(2.5, 16), "must be integers"),
    (lambda: BlockPool(8, 16).allocate(1.5), "an integer >= 0"),
    (lambda: BlockPool(8, 16).allocate("2"), "an integer >= 0"),
    (lambda: BlockPool(8, 16).free(0), "a sequence of block ids"),
])
def test_arguments_of_the_wrong_type_are_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
