"""KVCacheManager: block tables, prefix-hit locking, copy-on-write on fork."""
from __future__ import annotations

import pytest

from kvpage import BlockPool, KVCacheManager, RadixCache, Request

BS = 4


def make(num_blocks: int = 16, prefix: bool = True):
    pool = BlockPool(num_blocks, BS)
    cache = RadixCache(pool) if prefix else None
    return pool, cache, KVCacheManager(pool, cache)


def run(kv: KVCacheManager, request: Request, num_new: int, hit=None) -> None:
    """Allocate and offer the blocks the step fills to the cache, then pretend the model ran."""
    assert kv.allocate_slots(request, num_new, hit)
    kv.cache_scheduled_blocks(request, num_new)
    request.num_computed_tokens += num_new


def test_allocate_slots_grows_the_table_block_by_block():
    pool, _, kv = make(prefix=False)
    r = Request("r", list(range(6)))
    assert kv.num_blocks_needed(r, 6) == 2
    run(kv, r, 6)
    assert len(r.block_ids) == 2 and pool.fill(r.block_ids[1]) == 2
    run(kv, r, 2)  # fills the second block: no new block
    assert len(r.block_ids) == 2
    assert kv.num_blocks_needed(r, 1) == 1
    run(kv, r, 1)
    assert len(r.block_ids) == 3
    assert pool.fragmentation == pytest.approx(3 / 12)


def test_allocate_slots_failure_changes_nothing():
    pool, _, kv = make(num_blocks=2, prefix=False)
    r = Request("r", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert r.block_ids == [] and pool.num_free_blocks == 2
    run(kv, r, 8)
    assert not kv.allocate_slots(r, 1)
    assert len(r.block_ids) == 2 and r.num_computed_tokens == 8
    pool.check_integrity()


def test_prefix_match_leaves_at_least_one_token_to_compute():
    pool, cache, kv = make()
    a = Request("a", list(range(8)))
    run(kv, a, 8)
    assert cache.num_cached_blocks == 2
    same = Request("b", list(range(8)))  # fully cached prompt
    hit = kv.match_prefix(same)
    assert hit.num_tokens == 4 and hit.block_ids == tuple(a.block_ids[:1])
    longer = Request("c", list(range(9)))
    assert kv.match_prefix(longer).block_ids == tuple(a.block_ids)


def test_prefix_hit_locks_blocks_and_skips_cached_tokens():
    pool, cache, kv = make(num_blocks=4)
    a = Request("a", list(range(8)))
    run(kv, a, 8)
    kv.free(a)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    b = Request("b", list(range(8)) + [50, 51])
    hit = kv.match_prefix(b)
    assert hit.num_tokens == 8
    assert kv.allocate_slots(b, 2, hit)
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert b.block_ids[:2] == list(hit.block_ids) and len(b.block_ids) == 3
    assert all(pool.ref_count(x) == 1 for x in b.block_ids)
    # The locked hit blocks survive any amount of allocation pressure.
    pool.allocate(1)
    assert not pool.can_allocate(1)
    assert cache.match_prefix(b.all_token_ids).block_ids == hit.block_ids


def test_idle_hit_blocks_count_against_the_free_budget():
    pool, cache, kv = make(num_blocks=3)
    a = Request("a", list(range(8)))
    run(kv, a, 8)
    kv.free(a)
    pool.allocate(1)  # 2 free, both cached-idle
    b = Request("b", list(range(8)) + [1, 2, 3, 4, 5])
    hit = kv.match_prefix(b)
    # Locking the 2 idle hits uses up the pool; the 5 new tokens need 2 more blocks.
    assert not kv.allocate_slots(b, 5, hit)
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert all(pool.ref_count(x) == 0 for x in hit.block_ids)


def test_hit_only_at_admission():
    pool, cache, kv = make()
    a = Request("a", list(range(8)))
    run(kv, a, 8)
    b = Request("b", list(range(9)))
    run(kv, b, 1, kv.match_prefix(b))
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 1, kv.match_prefix(b))


def test_fork_shares_blocks_and_copy_on_write_on_append():
    pool, _, kv = make(prefix=False)
    parent = Request("p", list(range(6)))
    run(kv, parent, 6)
    child = Request("c", list(range(6)))
    kv.fork(parent, child)
    assert child.block_ids == parent.block_ids
    assert [pool.ref_count(b) for b in parent.block_ids] == [2, 2]
    shared_full, shared_partial = parent.block_ids
    child.all_token_ids.append(100)
    parent.all_token_ids.append(200)
    # The child appends into the shared partial block first: it gets a private copy.
    assert kv.num_blocks_needed(child, 1) == 1
    run(kv, child, 1)
    private = child.block_ids[1]
    assert private != shared_partial and child.block_ids[0] == shared_full
    assert kv.take_pending_copies([child, parent]) == [(shared_partial, private)]
    assert kv.take_pending_copies([child, parent]) == []
    assert pool.ref_count(shared_partial) == 1 and pool.ref_count(shared_full) == 2
    assert pool.fill(private) == 3
    # The parent is now the only holder of the partial block: it writes in place.
    run(kv, parent, 1)
    assert parent.block_ids == [shared_full, shared_partial]
    assert kv.take_pending_copies([child, parent]) == []
    kv.free(child)
    kv.free(parent)
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_integrity()


def test_fork_at_block_boundary_needs_no_copy():
    pool, _, kv = make(prefix=False)
    parent = Request("p", list(range(8)))
    run(kv, parent, 8)
    child = Request("c", list(range(8)))
    kv.fork(parent, child)
    child.all_token_ids.append(1)
    run(kv, child, 1)
    assert kv.take_pending_copies([child, parent]) == []
    assert child.block_ids[:2] == parent.block_ids and len(child.block_ids) == 3
    with pytest.raises(ValueError):
        kv.fork(parent, child)  # the target already holds blocks


def test_copy_on_write_needs_a_free_block():
    pool, _, kv = make(num_blocks=2, prefix=False)
    parent = Request("p", list(range(6)))
    run(kv, parent, 6)
    child = Request("c", list(range(6)))
    kv.fork(parent, child)
    child.all_token_ids.append(1)
    assert not kv.allocate_slots(child, 1)
    assert kv.take_pending_copies([child, parent]) == [] and pool.ref_count(parent.block_ids[1]) == 2


def test_cache_scheduled_blocks_inserts_chunk_by_chunk():
    pool, cache, kv = make()
    r = Request("r", list(range(14)))
    run(kv, r, 5)
    assert cache.num_cached_blocks == 1 and r.num_inserted_blocks == 1
    run(kv, r, 2)
    assert cache.num_cached_blocks == 1
    run(kv, r, 7)
    assert cache.num_cached_blocks == 3 and r.num_inserted_blocks == 3
    assert cache.match_prefix(r.all_token_ids).block_ids == tuple(r.block_ids[:3])
    cache.check_integrity()


def test_free_releases_tail_first_and_resets_progress():
    pool, cache, kv = make(num_blocks=3)
    r = Request("r", list(range(12)))
    run(kv, r, 12)
    blocks = list(r.block_ids)
    kv.free(r)
    assert r.block_ids == [] and r.num_computed_tokens == 0 and r.num_inserted_blocks == 0
    assert pool.num_free_blocks == 3
    pool.allocate(1)  # evicts the tail (the only leaf), keeping the head for a future hit
    assert pool.is_cached(blocks[0]) and pool.is_cached(blocks[1]) and not pool.is_cached(blocks[2])
