"""Scheduler: limits, decode-first budgeting, chunked prefill, prefix hits, preemption, endings."""
from __future__ import annotations

import pytest

from kvpage import CacheConfig, FinishReason, RequestStatus, SamplingParams, Scheduler, SchedulerConfig

BS = 4


def make(num_blocks=64, budget=64, max_seqs=8, max_model_len=64, chunked=True, prefix=True, **kw) -> Scheduler:
    return Scheduler(
        CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=prefix),
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            **kw,
        ),
    )


def params(max_tokens=4, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True), **kw)


def step(s: Scheduler, token: int = 1):
    out = s.schedule()
    finished = s.update_from_output(out, [token] * out.metadata.sample_seq_indices.shape[0])
    s.check_integrity()
    return out, finished


def scheduled(out) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(out.requests, out.num_new_tokens)}


def drain(s: Scheduler, max_steps: int = 500) -> int:
    for i in range(max_steps):
        if not s.has_unfinished_requests():
            return i
        step(s)
    raise AssertionError("requests did not drain")


def test_max_num_seqs_bounds_each_step():
    s = make(max_seqs=3)
    for i in range(7):
        s.make_request(f"r{i}", [i + 1] * 5, params())
    out, _ = step(s)
    assert list(scheduled(out)) == ["r0", "r1", "r2"]
    assert s.num_running == 3 and s.num_waiting == 4
    for _ in range(40):
        out, _ = step(s)
        assert out.metadata.num_seqs <= 3 and s.num_running <= 3
    assert not s.has_unfinished_requests()


def test_chunked_prefill_splits_long_prompt_and_shares_steps_with_decodes():
    s = make(budget=16, max_model_len=128, num_blocks=64)
    s.make_request("short", [1, 2, 3], params(max_tokens=10))
    step(s)  # "short" prefilled; it decodes from now on
    s.make_request("long", list(range(100, 150)), params())
    chunks = []
    for _ in range(4):
        out, _ = step(s)
        sched = scheduled(out)
        assert sched["short"] == 1 and out.metadata.num_tokens <= 16
        chunks.append(sched["long"])
        # A chunk that does not finish the prompt samples no token.
        assert ("long" in [out.requests[i].request_id for i in out.metadata.sample_seq_indices]) == (len(chunks) == 4)
    assert chunks == [15, 15, 15, 5]
    assert s.requests["long"].num_output_tokens == 1


def test_running_decodes_go_before_an_older_prefill_chunk():
    """Under the priority policy a newly admitted urgent prompt ranks before running decodes;
    its chunks still only take the budget the decodes leave."""
    s = make(budget=8, max_model_len=128, policy="priority")
    for i in range(3):
        s.make_request(f"d{i}", [i + 1] * 2, params(max_tokens=30, priority=5))
    step(s)
    s.make_request("urgent", list(range(40)), params(priority=0))
    s.make_request("later", [9, 9], params(priority=9))
    seen = []
    while s.requests["urgent"].num_computed_tokens < 40:
        out, _ = step(s)
        sched = scheduled(out)
        assert all(sched[f"d{i}"] == 1 for i in range(3)), sched
        assert out.metadata.num_decodes >= 3 and list(sched)[:3] == ["d0", "d1", "d2"]
        seen.append(sched["urgent"])
        assert "later" not in sched  # the budget went to the urgent prompt
    assert seen == [5] * 8


def test_without_chunking_a_prompt_runs_whole_or_waits():
    s = make(budget=64, max_model_len=64, chunked=False)
    s.make_request("a", list(range(40)), params(max_tokens=5))
    s.make_request("b", list(range(100, 130)), params(max_tokens=5))
    out, _ = step(s)
    assert scheduled(out) == {"a": 40}  # b does not fit the rest of the budget: it waits
    out, _ = step(s)
    assert scheduled(out) == {"a": 1, "b": 30}
    assert out.metadata.num_decodes == 1 and out.requests[0].request_id == "a"
    drain(s)


def test_token_budget_never_exceeded_under_load():
    s = make(budget=10, max_seqs=8, num_blocks=128, max_model_len=128)
    for i in range(12):
        s.make_request(f"r{i}", [i] * (3 + 5 * i), params(max_tokens=6))
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        out, _ = step(s)
        assert sum(out.num_new_tokens) == out.metadata.num_tokens <= 10
        assert out.metadata.num_seqs <= 8
    assert not s.has_unfinished_requests()


def test_prefix_cache_skips_cached_tokens_at_admission():
    s = make()
    prompt = list(range(1, 13))  # 3 full blocks
    s.make_request("a", prompt, params(max_tokens=1))
    drain(s)
    s.make_request("b", prompt + [77, 78], params(max_tokens=1))
    out, _ = step(s)
    b = out.requests[0]
    assert scheduled(out) == {"b": 2} and b.num_cached_tokens == 12
    assert out.metadata.positions.tolist() == [12, 13]
    assert out.metadata.num_computed_tokens.tolist() == [12]
    stats = s.stats()
    assert stats["prefix_cache_queries"] == 12 + 14 and stats["prefix_cache_hits"] == 12


def test_fully_cached_prompt_still_computes_its_last_block():
    s = make()
    prompt = list(range(1, 13))
    s.make_request("a", prompt, params(max_tokens=1))
    drain(s)
    s.make_request("b", prompt, params(max_tokens=2))
    out, _ = step(s)
    assert scheduled(out) == {"b": 4}  # the last block is recomputed to get logits
    assert out.metadata.logits_indices.tolist() == [3]
    assert s.requests["b"].num_output_tokens == 1


def test_prefix_caching_off_recomputes():
    s = make(prefix=False)
    s.make_request("a", list(range(12)), params(max_tokens=1))
    drain(s)
    s.make_request("b", list(range(12)), params(max_tokens=1))
    out, _ = step(s)
    assert scheduled(out) == {"b": 12}
    assert s.stats()["prefix_cache_queries"] == 0 and s.stats()["num_cached_blocks"] == 0


def test_preemption_recompute_newest_first_back_to_head_of_waiting():
    # 6 blocks of 4 tokens; three 8-token prompts take 2 blocks each, and the first decode
    # (position 8) of each needs a third.
    s = make(num_blocks=6, prefix=False)
    for name in ("old", "mid", "new"):
        s.make_request(name, [1] * 8, params(max_tokens=6))
    step(s)
    s.make_request("queued", [2] * 3, params(max_tokens=1))
    assert s.pool.num_free_blocks == 0
    out, _ = step(s)  # "old" needs a third block: the newest running request pays
    assert [r.request_id for r in out.preempted] == ["new"]
    new = s.requests["new"]
    assert new.status is RequestStatus.WAITING and new.block_ids == [] and new.num_computed_tokens == 0
    assert new.num_output_tokens == 1  # output kept for recompute
    assert [r.request_id for r in s.waiting] == ["new", "queued"]  # head of the line
    assert scheduled(out) == {"old": 1, "mid": 1}
    assert s.stats()["num_preemptions"] == 1
    drain(s)
    assert new.is_finished and new.num_output_tokens == 6
    assert s.pool.num_free_blocks == s.pool.num_blocks


def test_preempted_request_recomputes_its_outputs_and_is_counted_once_by_the_cache():
    s = make(num_blocks=4, max_model_len=32)
    a = s.make_request("a", [1] * 6, params(max_tokens=9))
    b = s.make_request("b", [2] * 6, params(max_tokens=9))
    preempted = []
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        out, _ = step(s)
        preempted += [r.request_id for r in out.preempted]
        for r, n in zip(out.requests, out.num_new_tokens):
            if r.request_id == "b" and r.num_preemptions and n > 1:
                assert r.num_output_tokens >= 1  # the recompute covers prompt + outputs
    assert preempted and set(preempted) <= {"b"}
    assert a.num_output_tokens == b.num_output_tokens == 9
    assert s.stats()["prefix_cache_queries"] == 12  # once per request, not per re-admission


def test_abort_frees_everything():
    s = make(num_blocks=16)
    s.make_request("run", list(range(10)), params(max_tokens=20))
    step(s)
    s.make_request("wait", list(range(10)), params())
    assert s.abort("run") and s.abort("wait")
    assert not s.abort("run") and not s.abort("nope")
    assert s.pool.num_free_blocks == s.pool.num_blocks and s.pool.num_used_blocks == 0
    assert not s.has_unfinished_requests() and s.schedule().is_empty
    s.check_integrity()


def test_abort_during_a_step_is_skipped_by_update():
    s = make()
    s.make_request("a", [1, 2, 3], params())
    s.make_request("b", [4, 5, 6], params())
    out = s.schedule()
    a = s.requests["a"]
    s.abort("a")
    finished = s.update_from_output(out, [9, 9])
    assert finished == [] and a.finish_reason is FinishReason.ABORT and a.num_output_tokens == 0
    assert s.requests["b"].output_token_ids == [9]
    s.check_integrity()


def test_finish_request_with_reason():
    s = make()
    s.make_request("a", [1, 2, 3], params())
    step(s)
    r = s.finish_request("a", FinishReason.STOP)
    assert r.finish_reason is FinishReason.STOP and r.is_finished
    assert s.finish_request("a", FinishReason.STOP) is None
    assert s.pool.num_free_blocks == s.pool.num_blocks


@pytest.mark.parametrize(
    "sp, eos, tokens, expect_len, reason",
    [
        (SamplingParams(max_tokens=3), None, [5, 5, 5, 5], 3, FinishReason.LENGTH),
        (SamplingParams(max_tokens=9), 7, [5, 7, 5], 2, FinishReason.STOP),  # EOS
        (SamplingParams(max_tokens=3, ignore_eos=True), 7, [7, 7, 7], 3, FinishReason.LENGTH),
        (SamplingParams(max_tokens=9, stop_token_ids=[8]), None, [5, 8], 2, FinishReason.STOP),
        (SamplingParams(max_tokens=9, stop_token_ids=[8], ignore_eos=True), None, [8], 1, FinishReason.STOP),
        # EOS in the first min_tokens - 1 outputs does not stop (as in vLLM's stop check).
        (SamplingParams(max_tokens=9, min_tokens=3), 7, [7, 7, 7, 7], 3, FinishReason.STOP),
    ],
)
def test_finish_conditions(sp, eos, tokens, expect_len, reason):
    s = make()
    r = s.make_request("r", [1, 2, 3], sp, eos_token_id=eos)
    for t in tokens:
        if r.is_finished:
            break
        out = s.schedule()
        s.update_from_output(out, [t])
    assert r.is_finished and r.finish_reason is reason and r.num_output_tokens == expect_len
    assert s.pool.num_free_blocks == s.pool.num_blocks


def test_finish_at_max_model_len():
    s = make(max_model_len=8)
    r = s.make_request("r", [1] * 5, params(max_tokens=100))
    drain(s)
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 8 and r.num_output_tokens == 3


def test_fcfs_is_the_default_and_priority_is_optional():
    def admitted(policy):
        s = make(max_seqs=1, **({"policy": policy} if policy else {}))
        for name, prio in (("low", 9), ("high", 0), ("mid", 5)):
            s.make_request(name, [1, 2], params(max_tokens=1, priority=prio))
        order = []
        for _ in range(10):
            out, _ = step(s)
            order += [r.request_id for r in out.requests]
        return order

    assert admitted(None) == ["low", "high", "mid"]
    assert admitted("priority") == ["high", "mid", "low"]


def test_update_from_output_advances_and_validates():
    s = make()
    r = s.make_request("r", [1, 2, 3, 4, 5], params(max_tokens=5))
    out = s.schedule()
    with pytest.raises(ValueError, match="sampled tokens"):
        s.update_from_output(out, [1, 2])
    s.update_from_output(out, [42])
    assert r.num_computed_tokens == 5 and r.output_token_ids == [42] and r.num_uncomputed_tokens == 1
    assert r.first_token_time is not None
    out = s.schedule()
    assert out.metadata.input_ids.tolist() == [42] and out.metadata.positions.tolist() == [5]
    s.update_from_output(out, [43])
    assert r.output_token_ids == [42, 43] and r.num_computed_tokens == 6


def test_fork_request_copies_on_write_through_metadata():
    s = make(prefix=False)
    s.make_request("p", [1, 2, 3, 4, 5], params(max_tokens=5))
    step(s)  # 5 prompt tokens computed; the shared partial block holds 1 of them
    parent = s.requests["p"]
    child = s.fork_request("p", "c")
    assert child.block_ids == parent.block_ids and child.output_token_ids == parent.output_token_ids
    shared = parent.block_ids[1]
    out, _ = step(s)
    copies = out.metadata.block_copies.tolist()
    assert len(copies) == 1 and copies[0][0] == shared
    dst = copies[0][1]
    # Whoever appended first got the private copy; the other keeps writing the original.
    assert {parent.block_ids[1], child.block_ids[1]} == {shared, dst}
    row = {rid: i for i, rid in enumerate(out.metadata.request_ids)}
    assert out.metadata.block_tables[row["p"], 1] == parent.block_ids[1]
    assert out.metadata.block_tables[row["c"], 1] == child.block_ids[1]
    with pytest.raises(ValueError):
        s.fork_request("p", "c")  # id in use
    with pytest.raises(ValueError):
        s.fork_request("missing", "x")
    drain(s)
    assert s.pool.num_free_blocks == s.pool.num_blocks


def test_fork_respects_max_num_seqs():
    s = make(max_seqs=1)
    s.make_request("p", [1, 2], params())
    step(s)
    with pytest.raises(ValueError, match="max_num_seqs"):
        s.fork_request("p", "c")


def test_stats_reports_counters():
    s = make(num_blocks=16)
    s.make_request("a", list(range(6)), params(max_tokens=3))
    s.make_request("b", list(range(10, 16)), params(max_tokens=3))
    step(s)
    st = s.stats()
    assert st["num_blocks"] == 16 and st["num_running"] == 2 and st["num_waiting"] == 0
    assert st["num_free_blocks"] == 16 - 4 and st["kv_cache_usage"] == pytest.approx(4 / 16)
    # Each request holds 6 tokens in 8 slots.
    assert st["kv_fragmentation"] == pytest.approx(4 / 16)
    assert st["num_preemptions"] == 0 and st["num_thrash_pins"] == 0


def test_empty_schedule():
    s = make()
    out = s.schedule()
    assert out.is_empty and out.metadata.num_tokens == 0 and out.metadata.num_seqs == 0
    assert s.update_from_output(out, []) == []


def test_a_prefix_computed_in_this_step_is_shared_in_this_step():
    """Every layer writes the step's K/V before attending, so b may read a's blocks at once."""
    s = make(num_blocks=16)
    s.make_request("a", list(range(10)), params(max_tokens=3))
    s.make_request("b", list(range(10)) + [7], params(max_tokens=3))
    out = s.schedule()
    a, b = s.requests["a"], s.requests["b"]
    assert b.block_ids[:2] == a.block_ids[:2] and b.num_cached_tokens == 8
    assert out.num_new_tokens == [10, 3]
    assert sorted(out.newly_cached_blocks) == sorted(a.block_ids[:2])
    s.check_integrity()


def test_a_failed_step_forgets_the_cache_entries_it_made():
    s = make(num_blocks=16)
    s.make_request("a", list(range(10)), params(max_tokens=3))
    out = s.schedule()
    assert s.prefix_cache.num_cached_blocks == 2
    s.finish_request("a", FinishReason.ERROR, "boom")
    assert s.discard_step_cache(out) == 2
    assert s.prefix_cache.num_cached_blocks == 0 and s.pool.num_free_blocks == 16
    s.make_request("b", list(range(10)), params(max_tokens=3))
    s.schedule()
    assert s.requests["b"].num_cached_tokens == 0  # nothing stale was served
    s.check_integrity()


def test_a_prefilling_request_with_parallel_samples_keeps_seats_for_them():
    """A request with ``n=3`` still in prefill holds three seats: requests admitted after it
    leave room for the samples it forks into after its first token (found by the tier fuzz,
    where the forks pushed the running set past ``max_num_seqs``)."""
    s = make(budget=8, max_seqs=4)
    s.make_request("parent", list(range(3, 23)), params(n=3))  # 20 tokens: three chunks of 8
    out, _ = step(s)
    assert scheduled(out) == {"parent": 8}
    for name in ("a", "b", "c"):
        s.make_request(name, [5, 6], params())
    out, _ = step(s)
    assert scheduled(out) == {"parent": 8}  # "a" would take a seat the forks need
    out, _ = step(s)  # the last chunk (4 tokens) leaves budget for "a", and its seat is free
    assert scheduled(out) == {"parent": 4, "a": 2} and s.requests["parent"].num_output_tokens == 1
    for k in (1, 2):
        s.fork_request("parent", f"parent#{k}", sample_index=k, check_seats=False)
    for _ in range(2):  # (every sequence here stops at 4 tokens)
        out, _ = step(s)
        assert s.num_running == 4 and "b" not in scheduled(out)  # every seat taken while "a" runs


@pytest.mark.parametrize("prompt, params, match", [
    ("hello", None, "sequence of token ids"),
    ([-5, 3], None, "non-negative"),
    ([1.5, 2.7], None, "token ids are integers"),
    ([True, 2], None, "token ids are integers"),
    ([1, 2], {"max_tokens": 3}, "must be a SamplingParams"),
])
def test_a_bad_request_is_a_value_error_and_queues_nothing(prompt, params, match):
    sched = Scheduler(CacheConfig(block_size=4, num_blocks=8), SchedulerConfig(max_model_len=32))
    with pytest.raises(ValueError, match=match):
        sched.make_request("r", prompt, params)
    assert sched.num_waiting == 0


def test_configs_of_the_wrong_type_are_value_errors():
    with pytest.raises(ValueError, match="takes a CacheConfig and a SchedulerConfig"):
        Scheduler({"block_size": 16}, SchedulerConfig())
