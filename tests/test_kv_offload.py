"""The core of the tiers, without a model: block hashes, tier pools, offload decisions, config.

Block hashes must be the same in every process (they name disk files across restarts);
tier pools must balance (free + used == total) under any sequence of operations, which a
hypothesis test drives; the offload manager's plans are checked one decision at a time.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage import BlockPool, CacheConfig, EngineConfig, RadixCache, Request, SamplingParams, Scheduler, SchedulerConfig
from kvpage.core.block_hash import chain_hashes, external_hash, namespace_root
from kvpage.core.kv_events import MEDIUM_DISK, MEDIUM_HOST, MEDIUM_POOL, BlockRemoved, BlockStored, KVEventLog
from kvpage.core.offload.kv_offload import KVOffloadManager
from kvpage.core.offload.tier_pool import TierPool

TOKENS = list(range(3, 3 + 12))


def h(i: int) -> bytes:
    return bytes([i]) * 32


# ---------------------------------------------------------------------- block hashes
def test_block_hashes_are_the_same_in_another_process():
    code = ("from kvpage.core.block_hash import chain_hashes, namespace_root\n"
            f"print([x.hex() for x in chain_hashes(namespace_root('tenant'), {TOKENS!r}, 4)])")
    env_runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                               env={"PYTHONHASHSEED": seed, "PATH": ""}) for seed in ("1", "2")]
    here = str([x.hex() for x in chain_hashes(namespace_root("tenant"), TOKENS, 4)])
    for run in env_runs:
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == here


def test_hashes_chain_and_keep_namespaces_apart():
    a = chain_hashes(namespace_root(None), TOKENS, 4)
    assert len(a) == 3 and len(set(a)) == 3
    assert chain_hashes(a[0], TOKENS[4:], 4) == a[1:]  # each block chains on its parent
    assert chain_hashes(namespace_root("x"), TOKENS, 4)[0] != a[0]
    assert chain_hashes(namespace_root(None), [TOKENS[0] + 1] + TOKENS[1:], 4)[2] != a[2]  # the prefix counts
    assert 0 <= external_hash(a[0]) < 2**64


def test_request_hashes_grow_with_its_tokens_and_match_the_radix_tree():
    request = Request("r", TOKENS[:6], namespace="ns")
    assert request.full_block_hashes(1, 4) == chain_hashes(namespace_root("ns"), TOKENS[:4], 4)
    request.all_token_ids += TOKENS[6:]
    assert request.full_block_hashes(3, 4) == chain_hashes(namespace_root("ns"), TOKENS, 4)
    pool = BlockPool(8, 4)
    cache = RadixCache(pool)
    blocks = pool.allocate(3)
    cache.insert(TOKENS, blocks, namespace="ns")
    assert [cache.cached_block(b)[0] for b in blocks] == request.full_block_hashes(3, 4)
    assert cache.cached_block(blocks[1])[1] == request.block_hashes[0]  # parent hash
    assert cache.cached_block(blocks[0])[1] is None


def test_the_radix_tree_logs_stored_and_removed_pool_blocks():
    pool, events = BlockPool(8, 4), KVEventLog(enabled=True)
    cache = RadixCache(pool, events=events)
    blocks = pool.allocate(3)
    cache.insert(TOKENS, blocks)
    pool.free(blocks[::-1])
    cache.evict(1)
    stored, removed = events.take()
    hashes = chain_hashes(namespace_root(None), TOKENS, 4)
    assert stored == BlockStored(tuple(hashes), None, tuple(TOKENS), 4, MEDIUM_POOL)
    assert removed == BlockRemoved((hashes[2],), MEDIUM_POOL)


# ---------------------------------------------------------------------- tier pools
def test_tier_pool_evicts_least_recently_used_unpinned():
    tier = TierPool("host", 2)
    assert tier.allocate(h(1)) == (0, [])
    tier.allocate(h(2))
    tier.touch(h(1))
    slot, evicted = tier.allocate(h(3))
    assert evicted == [h(2)] and tier.lookup(h(3)) == slot
    tier.pin(h(1))
    tier.pin(h(3))
    assert tier.allocate(h(4)) == (None, [])  # everything pinned: nothing changes
    assert len(tier) == 2
    tier.unpin(h(3))
    assert tier.allocate(h(4))[1] == [h(3)]
    with pytest.raises(ValueError, match="already holds"):
        tier.allocate(h(4))
    tier.check_integrity()


def test_pending_entries_are_invisible_to_lookups():
    tier = TierPool("host", 2)
    tier.allocate(h(1), ready=False)
    assert tier.lookup(h(1)) is None and h(1) in tier and tier.ready_hashes() == []


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "pending", "remove", "pin", "unpin", "touch", "clear"]),
                          st.integers(0, 9)), max_size=60), st.integers(1, 6))
def test_tier_pool_free_plus_used_is_total(ops, size):
    tier = TierPool("t", size)
    for op, i in ops:
        key = h(i)
        if op in ("alloc", "pending"):
            if key not in tier:
                slot, evicted = tier.allocate(key, ready=op == "alloc")
                assert (slot is None) == (len(tier) == size and key not in tier)
                assert all(e not in tier for e in evicted)
        elif op == "remove":
            tier.remove(key)
        elif op == "pin" and key in tier:
            tier.pin(key)
        elif op == "unpin":
            tier.unpin(key)
        elif op == "touch":
            tier.touch(key)
        elif op == "clear":
            tier.clear()
        assert tier.num_free_slots + tier.num_used_slots == tier.num_slots
        tier.check_integrity()


# ---------------------------------------------------------------------- offload decisions
def test_a_pool_eviction_is_stored_once_to_host():
    events = KVEventLog(enabled=True)
    offload = KVOffloadManager(4, num_host_blocks=2, events=events)
    offload.on_pool_evict(h(1), 7, TOKENS[:4], None)
    offload.on_pool_evict(h(1), 7, TOKENS[:4], None)  # already there: no second copy
    transfers = offload.take_step_transfers()
    assert transfers.host_stores.tolist() == [[7, offload.host.lookup(h(1))]]
    assert transfers.store_hashes == [h(1)]
    assert events.take() == [BlockStored((h(1),), None, tuple(TOKENS[:4]), 4, MEDIUM_HOST)]
    assert offload.take_step_transfers() is None


def test_a_store_into_a_slot_reused_the_same_step_is_dropped():
    offload = KVOffloadManager(4, num_host_blocks=1, num_disk_blocks=4)
    offload.on_pool_evict(h(1), 5, TOKENS[:4], None)
    offload.disk.allocate(h(2))
    offload.start_fetches([h(2)])  # evicts h(1) from host: its store must not land on the read's slot
    transfers = offload.take_step_transfers()
    assert len(transfers.host_stores) == 0 and transfers.disk_fetches == [(h(2), 0)]


def test_lookup_splits_ready_fetch_and_pending():
    offload = KVOffloadManager(4, num_host_blocks=4, num_disk_blocks=4)
    offload.host.allocate(h(1))
    offload.disk.allocate(h(2))
    offload.host.allocate(h(3), ready=False)
    offload.host.allocate(h(4))
    found = offload.lookup([h(1), h(2), h(3), h(4), h(9), h(1)])
    assert found.ready == (h(1),) and found.fetch == (h(2),) and found.pending == (h(3),)
    assert offload.lookup([h(9), h(1)]).ready == ()  # a chain stops at its first miss


def test_fetches_complete_into_loadable_entries_or_drop_both_copies():
    events = KVEventLog(enabled=True)
    offload = KVOffloadManager(4, num_host_blocks=4, num_disk_blocks=4, events=events)
    offload.restore_disk([h(1), h(2)])
    assert offload.start_fetches([h(1), h(2), h(3)]) == [h(1), h(2)]
    offload.take_step_transfers()
    offload.complete_fetch(h(1), ok=True)
    offload.complete_fetch(h(2), ok=False)
    assert offload.host.lookup(h(1)) is not None and offload.host.entry(h(1)).from_disk
    assert h(2) not in offload.host and h(2) not in offload.disk
    assert offload.counters["disk_fetch_failures"] == 1
    assert events.take()[-2:] == [BlockStored((h(1),), None, (), 4, MEDIUM_HOST), BlockRemoved((h(2),), MEDIUM_DISK)]
    offload.check_integrity()


def test_held_entries_outlive_lru_pressure_until_released():
    offload = KVOffloadManager(4, num_host_blocks=2, num_disk_blocks=4)
    offload.restore_disk([h(1)])
    offload.host.allocate(h(2))
    offload.start_fetches([h(1)])
    offload.hold("a", [h(2), h(1), h(9)])  # a hash with no host entry is skipped
    offload.take_step_transfers()
    offload.complete_fetch(h(1), ok=True)  # the read's pin goes; the hold's stays
    offload.check_integrity()
    for i in (3, 4):
        offload.on_pool_evict(h(i), i, TOKENS[:4], None)  # every slot is held: the stores are dropped
    assert h(1) in offload.host and h(2) in offload.host and h(3) not in offload.host
    offload.release("a")
    offload.release("a")  # a second release is a no-op
    offload.on_pool_evict(h(5), 5, TOKENS[:4], None)
    assert h(5) in offload.host and offload.host.num_used_slots == 2
    offload.check_integrity()


def test_a_hold_on_a_replaced_entry_releases_nothing():
    offload = KVOffloadManager(4, num_host_blocks=2, num_disk_blocks=4)
    offload.restore_disk([h(1)])
    offload.start_fetches([h(1)])
    offload.hold("a", [h(1)])
    offload.take_step_transfers()
    offload.complete_fetch(h(1), ok=False)  # both copies go, and with them what "a" held
    offload.host.allocate(h(1))
    offload.hold("b", [h(1)])
    offload.release("a")
    assert offload.host.entry(h(1)).pins == 1  # "b"'s pin survives "a"'s release
    offload.check_integrity()
    offload.clear()
    assert offload.holders() == []
    offload.check_integrity()


def _scheduler_with_blocks_on_disk(prompt: list[int]) -> Scheduler:
    """An 8-block pool, a 4-slot host tier and a disk tier holding ``prompt``'s full blocks."""
    sched = Scheduler(CacheConfig(block_size=4, num_blocks=8, num_host_blocks=4, num_disk_blocks=8),
                      SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64))
    full = len(prompt) // 4 * 4
    sched.tiers.restore_disk(chain_hashes(namespace_root(None), prompt[:full], 4))
    return sched


def test_a_request_waiting_for_disk_keeps_what_it_waited_for():
    """Pool evictions during the wait would push the read blocks out of a small host tier;
    the parked request holds them, so its admission loads every one."""
    prompt = list(range(200, 213))
    sched = _scheduler_with_blocks_on_disk(prompt)
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def step():
        out = sched.schedule()
        sched.update_from_output(out, [1] * out.metadata.sample_seq_indices.shape[0])
        sched.check_integrity()
        return out

    sched.make_request("c", list(range(100, 116)), params)  # leaves 4 idle cached blocks to evict
    step()
    sched.make_request("b", list(range(300, 320)), SamplingParams(max_tokens=8, ignore_eos=True))
    waiter = sched.make_request("a", prompt, params)
    out = step()
    assert len(out.kv_transfers.disk_fetches) == 3 and sched.num_waiting == 1
    sched.tiers.complete_fetches([(block_hash, True) for block_hash, _ in out.kv_transfers.disk_fetches])
    steps_waited = 0
    while not waiter.num_computed_tokens and steps_waited < 20:
        step()  # "b" grows while "a" cannot be admitted; its evictions reach the host tier
        steps_waited += 1
    assert steps_waited > 1 and sched.offload.counters["host_stores"] > 1
    assert waiter.num_cached_tokens == 12
    assert sched.offload.counters["disk_loads"] == 3 and sched.offload.holders() == []


def test_a_parked_request_that_ends_releases_its_holds():
    prompt = list(range(200, 213))
    sched = _scheduler_with_blocks_on_disk(prompt)
    sched.make_request("a", prompt, SamplingParams(max_tokens=1))
    sched.schedule()
    assert sched.offload.holders() == ["a"]
    sched.abort("a")
    assert sched.offload.holders() == []
    sched.check_integrity()


def test_saves_are_write_through_deduplicated_and_lru_capped():
    offload = KVOffloadManager(4, num_host_blocks=2, num_disk_blocks=2)
    ops = offload.plan_saves([(h(1), 1, None, ()), (h(2), 2, h(1), ()), (h(1), 1, None, ())])
    assert [(op.kind, op.block_hash) for op in ops] == [("save", h(1)), ("save", h(2))]
    ops = offload.plan_saves([(h(3), 3, h(2), ())])  # h(1) was touched by its repeat: h(2) is the oldest
    assert [(op.kind, op.block_hash) for op in ops] == [("remove", h(2)), ("save", h(3))]
    offload.complete_save_failure(h(3))
    assert h(3) not in offload.disk
    offload.disk_writable = False
    assert offload.plan_saves([(h(4), 4, None, ())]) == []


def test_restoring_more_entries_than_the_cap_removes_the_oldest():
    offload = KVOffloadManager(4, num_host_blocks=1, num_disk_blocks=2)
    ops = offload.restore_disk([h(1), h(2), h(3)])
    assert [(op.kind, op.block_hash) for op in ops] == [("remove", h(1))]
    assert offload.disk.ready_hashes() == [h(2), h(3)]


# ---------------------------------------------------------------------- configuration
@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_offloading_size=0), "kv_offloading_size must be a positive number"),
    (dict(kv_offloading_size=float("nan")), "kv_offloading_size"),
    (dict(kv_disk_cache_size=1.0), "needs kv_disk_cache"),
    (dict(kv_disk_cache=""), "kv_disk_cache must be a directory"),
    (dict(kv_offloading_size=1.0, enable_prefix_caching=False), "need enable_prefix_caching"),
])
def test_bad_tier_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_tier_sizes_become_blocks():
    config = EngineConfig(kv_offloading_size=1.0, kv_disk_cache="/tmp/x", kv_disk_cache_size=2.0)
    assert config.tier_blocks(2**20, 2048) == (1024, 2 * 1024 * 1024 // 1028)  # 1 MiB blocks + a 4 KiB header unit
    staging = EngineConfig(kv_disk_cache="/tmp/x", block_size=16).tier_blocks(4096, 1024)
    assert staging[0] == 2 * 1024 // 16  # disk alone reads through two max-length sequences of host memory
    with pytest.raises(ValueError, match="holds no KV block"):
        EngineConfig(kv_offloading_size=1e-9).tier_blocks(4096, 1024)
    with pytest.raises(ValueError, match="needs num_host_blocks"):
        CacheConfig(num_disk_blocks=4)
