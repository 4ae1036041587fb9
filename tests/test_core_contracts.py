"""The core embedded as a library: bad input and protocol mistakes are ``ValueError``s that
change nothing, and the scheduler goes on serving the other requests afterwards."""
from __future__ import annotations

import pytest

from kvpage import (BlockPool, CacheConfig, FinishReason, KVCacheManager, RadixCache, Request, SamplingParams,
                    Scheduler, SchedulerConfig)


def make(**cache) -> Scheduler:
    return Scheduler(CacheConfig(block_size=4, num_blocks=32, **cache),
                     SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64))


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 3), ignore_eos=True, **kw)


def sample_rows(out) -> int:
    return out.metadata.sample_seq_indices.shape[0]


def run_to_end(s: Scheduler, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return
        out = s.schedule()
        s.update_from_output(out, [7] * sample_rows(out))
        s.check_integrity()
    raise AssertionError("requests did not drain")


@pytest.mark.parametrize("args, kwargs, match", [
    (("r", [1, 2**63, 3]), {}, "below 2\\*\\*63"),
    (("r", [1, 2**80]), {}, "below 2\\*\\*63"),
    (("r", [1, 2, 3], None, None, ["ns"]), {}, "namespace must be hashable"),
    (("r", [1, 2, 3], params()), {"eos_token_id": "2"}, "eos_token_id"),
    (("r", [1, 2, 3], params()), {"eos_token_id": -1}, "eos_token_id"),
    (("r", [1, 2, 3], params()), {"eos_token_id": True}, "eos_token_id"),
    ((None, [1, 2, 3]), {}, "request id is a string"),
])
def test_a_bad_request_is_refused_and_the_others_run(args, kwargs, match):
    s = make()
    with pytest.raises(ValueError, match=match):
        s.make_request(*args, **kwargs)
    s.make_request("good", [1, 2, 3, 4, 5], params())
    run_to_end(s)
    assert s.pool.num_free_blocks == s.pool.num_blocks


def test_a_step_is_applied_once_and_before_the_next():
    s = make()
    s.make_request("a", list(range(10, 15)), params(max_tokens=4))
    out = s.schedule()
    with pytest.raises(ValueError, match="not applied"):
        s.schedule()
    s.update_from_output(out, [7])
    with pytest.raises(ValueError, match="applied already"):
        s.update_from_output(out, [8])
    request = s.requests["a"]
    assert request.output_token_ids == [7] and request.num_computed_tokens == 5
    s.check_integrity()
    run_to_end(s)


def test_a_failed_step_ends_its_requests_and_scheduling_goes_on():
    s = make()
    s.make_request("a", [1, 2, 3], params())
    out = s.schedule()
    s.finish_requests([r.request_id for r in out.requests], FinishReason.ABORT)  # the engine's failure path
    s.discard_step_cache(out)
    s.make_request("b", [4, 5, 6], params())
    run_to_end(s)


@pytest.mark.parametrize("tokens, match", [([-5], "integers >= 0"), ([1.7], "integers >= 0"), ([1, 2], "expected 1")])
def test_bad_sampled_tokens_change_nothing(tokens, match):
    s = make()
    s.make_request("a", [1, 2, 3], params())
    out = s.schedule()
    with pytest.raises(ValueError, match=match):
        s.update_from_output(out, tokens)
    assert s.requests["a"].num_computed_tokens == 0
    s.update_from_output(out, [9])  # the right call still goes through
    assert s.requests["a"].output_token_ids == [9]


@pytest.mark.parametrize("forks, match", [
    ({0: list(range(20, 29))}, "has n=3, so 2 other samples, got 9"),
    ({0: [1, -2]}, "integers >= 0"),
    ({3: [1, 2]}, "names rows \\[3\\]"),
    ([[1, 2]], "must map sampled rows"),
])
def test_bad_forks_change_nothing(forks, match):
    s = make()
    s.make_request("g", list(range(10, 15)), params(n=3))
    out = s.schedule()
    with pytest.raises(ValueError, match=match):
        s.update_from_output(out, [7], fork_token_ids=forks)
    assert set(s.requests) == {"g"} and s.requests["g"].num_computed_tokens == 0
    s.update_from_output(out, [7], fork_token_ids={0: [8, 9]})
    assert sorted(s.requests) == ["g", "g#1", "g#2"]
    assert [s.requests[k].output_token_ids for k in sorted(s.requests)] == [[7], [8], [9]]
    out = s.schedule()
    with pytest.raises(ValueError, match="forks only at the first token"):
        s.update_from_output(out, [1] * sample_rows(out), fork_token_ids={0: [1, 2]})
    s.update_from_output(out, [1] * sample_rows(out))
    run_to_end(s)


@pytest.mark.parametrize("cache, match", [
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False"),
    ({"enable_kv_events": "yes"}, "enable_kv_events must be True or False"),
    ({"group_windows": None}, "group_windows must be a sequence"),
    ({"group_windows": (None, 0)}, "positive integer"),
])
def test_cache_config_fields_are_checked(cache, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(block_size=4, num_blocks=8, **cache)


def test_scheduler_config_switch_is_a_bool():
    with pytest.raises(ValueError, match="enable_chunked_prefill must be True or False"):
        SchedulerConfig(enable_chunked_prefill="no")


def test_a_refused_insert_caches_nothing():
    pool = BlockPool(4, 4)
    cache = RadixCache(pool)
    with pytest.raises(ValueError, match="must be in use"):
        cache.insert([9, 9, 9, 9], [0])
    assert pool.allocate(1) == [0]  # block 0 now holds other tokens: no entry may point at it
    assert cache.match_prefix([9, 9, 9, 9, 1]).num_tokens == 0
    pool.check_integrity()


def test_a_refused_allocation_evicts_nothing():
    pool = BlockPool(4, 4)
    cache = RadixCache(pool)
    blocks = pool.allocate(2)
    cache.insert(list(range(8)), blocks)
    pool.free(blocks)  # idle, cached: evictable
    for bad in ({"tag": 5}, {"tag": True}):
        with pytest.raises(ValueError, match="tag must be"):
            pool.allocate(3, **bad)
    with pytest.raises(ValueError, match="num_blocks must be"):
        pool.allocate(True)
    assert pool.num_cached_blocks == 2 and cache.match_prefix(list(range(9))).num_tokens == 8


@pytest.mark.parametrize("windows", [(None, 0), (None, -4), (None, "x"), (None, 2.5), None])
def test_kv_cache_manager_windows_are_checked(windows):
    with pytest.raises(ValueError, match="window"):
        KVCacheManager(BlockPool(8, 4, num_tags=2), windows=windows)


def test_kv_cache_manager_wiring_is_checked():
    pool = BlockPool(8, 4)
    with pytest.raises(ValueError, match="own pool"):
        KVCacheManager(pool, RadixCache(BlockPool(8, 4)))
    with pytest.raises(ValueError, match="as many tags"):
        KVCacheManager(pool, windows=(None, 8))
    manager = KVCacheManager(pool)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(Request("r", [1, 2, 3]), -2)
    assert pool.num_free_blocks == 8


def test_endings_are_checked():
    s = make()
    s.make_request("abc", [1, 2, 3], params())
    with pytest.raises(ValueError, match="FinishReason"):
        s.finish_request("abc", None)
    with pytest.raises(ValueError, match="collection of ids"):
        s.finish_requests("abc", FinishReason.ABORT)
    assert s.finish_requests(["abc"], FinishReason.ABORT)[0].finish_reason is FinishReason.ABORT


def test_step_metadata_needs_the_slots_it_maps():
    from kvpage.core.sched.metadata import build_step_metadata

    request = Request("r", [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="allocate_slots first"):
        build_step_metadata([request], [5], block_size=4)
    pool = BlockPool(8, 4)
    manager = KVCacheManager(pool)
    assert manager.allocate_slots(request, 5)
    assert build_step_metadata([request], [5], block_size=4).slot_mapping.shape == (5,)
    with pytest.raises(ValueError, match="at least one token"):
        build_step_metadata([request], [0], block_size=4)

