"""Configuration and request validation: every bad value raises ValueError naming the field."""
from __future__ import annotations

import math

import pytest

from kvpage import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig
from kvpage.core.config import EngineConfig


def test_defaults_are_valid():
    cache, sched = CacheConfig(), SchedulerConfig()
    assert cache.num_token_slots == cache.block_size * cache.num_blocks
    Scheduler(cache, sched)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_size": 12}, "block_size"),  # not a power of two
        ({"block_size": 0}, "block_size"),
        ({"block_size": -16}, "block_size"),
        ({"block_size": 16.0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": -1}, "num_blocks"),
        ({"num_blocks": None}, "num_blocks"),
    ],
)
def test_bad_cache_config(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        CacheConfig(**kwargs)


@pytest.mark.parametrize("block_size", [1, 2, 8, 16, 32, 256])
def test_power_of_two_block_sizes_accepted(block_size):
    assert CacheConfig(block_size=block_size).block_size == block_size


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": -3}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"max_model_len": 1.5}, "max_model_len"),
        ({"policy": "lifo"}, "policy"),
        ({"max_waiting": 0}, "max_waiting"),
        ({"max_preemptions_before_pin": 0}, "max_preemptions_before_pin"),
        # Without chunking a prompt runs whole, so the budget must hold the longest one.
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 1024, "max_model_len": 2048}, "max_num_batched_tokens"),
    ],
)
def test_bad_scheduler_config(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SchedulerConfig(**kwargs)


def test_budget_below_one_block_without_chunking_is_rejected():
    sched = SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=8, max_model_len=8)
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens\b"):
        Scheduler(CacheConfig(block_size=16, num_blocks=8), sched)
    # With chunking a small budget only means small chunks.
    Scheduler(CacheConfig(block_size=16, num_blocks=8), SchedulerConfig(max_num_batched_tokens=8, max_model_len=64))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"priority": "high"}, "priority"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_normalization():
    p = SamplingParams(stop="###", stop_token_ids=[3, 4], temperature=0)
    assert p.stop == ["###"] and p.stop_token_ids == (3, 4) and p.greedy
    assert SamplingParams(stop=None).stop == [] and not SamplingParams().greedy


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        Request("r", [])


def make_scheduler(num_blocks=4, block_size=4, max_model_len=32, **kwargs) -> Scheduler:
    return Scheduler(
        CacheConfig(block_size=block_size, num_blocks=num_blocks),
        SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=64, **kwargs),
    )


def test_prompt_reaching_max_model_len_is_rejected_at_add():
    s = make_scheduler(num_blocks=16)
    with pytest.raises(ValueError, match="max_model_len"):
        s.make_request("r", list(range(32)))
    s.make_request("ok", list(range(31)), SamplingParams(max_tokens=1))
    assert s.num_waiting == 1 and "r" not in s.requests


def test_request_larger_than_the_pool_is_rejected_at_add():
    s = make_scheduler(num_blocks=4, block_size=4)  # 16 KV slots
    with pytest.raises(ValueError, match="pool"):
        s.make_request("big", list(range(17)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="pool"):
        s.make_request("grows", list(range(10)), SamplingParams(max_tokens=8))
    # The last sampled token never needs a KV slot: 10 + 7 - 1 = 16 slots fit exactly.
    s.make_request("exact", list(range(10)), SamplingParams(max_tokens=7))
    assert s.num_waiting == 1 and s.stats()["num_waiting"] == 1


def test_exactly_fitting_request_runs_to_completion():
    s = make_scheduler(num_blocks=4, block_size=4)
    r = s.make_request("exact", list(range(10)), SamplingParams(max_tokens=7, ignore_eos=True))
    for _ in range(20):
        out = s.schedule()
        if out.is_empty:
            break
        s.update_from_output(out, [1] * len(out.metadata.sample_seq_indices))
        s.check_integrity()
    assert r.is_finished and r.num_output_tokens == 7 and s.num_preemptions == 0


def test_duplicate_request_id_is_rejected():
    s = make_scheduler(num_blocks=16)
    s.make_request("r", [1, 2, 3])
    with pytest.raises(ValueError, match="already in use"):
        s.make_request("r", [4, 5, 6])


def test_waiting_queue_limit():
    from kvpage import QueueFullError

    s = make_scheduler(num_blocks=16, max_waiting=2)
    s.make_request("a", [1])
    s.make_request("b", [1])
    with pytest.raises(QueueFullError):
        s.make_request("c", [1])
    assert s.num_waiting == 2 and "c" not in s.requests


def test_the_default_mode_compiles_on_cpu_with_onednn_and_replays_decode_graphs_on_gpu(monkeypatch):
    monkeypatch.setenv("KVPAGE_EXACT", "0")
    config = EngineConfig()
    assert (config.compiles("cpu"), config.compiles("cuda"), config.uses_onednn) == (True, False, True)
    assert (config.captures_graphs("cpu"), config.captures_graphs("cuda")) == (False, True)
    eager = EngineConfig(enforce_eager=True, onednn_linears=False)
    assert (eager.compiles("cpu"), eager.uses_onednn, eager.captures_graphs("cuda")) == (False, False, False)
    compiled = EngineConfig(enforce_eager=False)
    assert (compiled.compiles("cuda"), compiled.captures_graphs("cuda")) == (True, True)


def test_the_exact_mode_is_eager_with_torch_linears(monkeypatch):
    monkeypatch.setenv("KVPAGE_EXACT", "0")
    config = EngineConfig(exact=True)
    assert (config.compiles("cpu"), config.compiles("cuda"), config.uses_onednn) == (False, False, False)
    assert not config.captures_graphs("cuda")
    assert EngineConfig(exact=True, enforce_eager=True, onednn_linears=False).exact_mode


@pytest.mark.parametrize("kwargs", [{"enforce_eager": False}, {"onednn_linears": True}])
def test_the_exact_mode_refuses_settings_that_contradict_it(kwargs):
    with pytest.raises(ValueError, match="exact=True runs the model eagerly"):
        EngineConfig(exact=True, **kwargs)


@pytest.mark.parametrize("field", ["exact", "enforce_eager", "onednn_linears"])
def test_mode_switches_must_be_booleans(field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: "yes"})


def test_the_environment_exact_mode_sets_defaults_but_keeps_explicit_settings(monkeypatch):
    monkeypatch.setenv("KVPAGE_EXACT", "1")
    assert (EngineConfig().compiles("cpu"), EngineConfig().uses_onednn) == (False, False)
    assert not EngineConfig().captures_graphs("cuda")
    asked = EngineConfig(enforce_eager=False, onednn_linears=True)
    assert (asked.compiles("cpu"), asked.uses_onednn) == (True, True)
