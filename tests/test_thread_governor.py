"""The thread governor: fewer threads while other processes keep our CPUs busy, with hysteresis."""
from __future__ import annotations

import os

import pytest

from kvpage.platform.thread_governor import (ThreadGovernor, governor_for, nearest_allowed, read_cpu_busy_ticks, read_own_ticks,
                                   threads_for)


def test_threads_for_rounds_the_free_cores():
    assert threads_for(2, 0.0, 2) == 2
    assert threads_for(2, 0.3, 2) == 2  # a light neighbour: keep both
    assert threads_for(2, 1.0, 2) == 1  # one core taken
    assert threads_for(2, 2.0, 2) == 1  # never below one
    assert threads_for(8, 2.6, 8) == 5
    assert threads_for(8, 0.0, 4) == 4  # never above the configured count


class _FakeCounters:
    """Busy ticks of our CPUs and our own ticks, advanced by hand (100 ticks per second)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0
        self.own = 0

    def advance(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += int(100 * seconds * own_cores)
        self.busy += int(100 * seconds * (own_cores + other_cores))


def _governor(counters: _FakeCounters, applied: list) -> ThreadGovernor:
    gov = ThreadGovernor(2, applied.append, cpus=[0, 1], interval_s=0.5, clock=lambda: counters.now,
                         read_busy=lambda cpus: counters.busy, read_own=lambda: counters.own)
    gov._hz = 100
    return gov


def test_a_busy_neighbour_halves_the_threads_after_two_checks_and_they_come_back():
    counters, applied = _FakeCounters(), []
    gov = _governor(counters, applied)
    assert gov.tick() == 2  # within the first interval (sampled when built): no look yet
    for _ in range(3):
        counters.advance(0.6, own_cores=2.0, other_cores=0.0)
        assert gov.tick() == 2
    counters.advance(0.6, own_cores=1.0, other_cores=1.0)
    assert gov.tick() == 2 and not applied  # seen once: not yet
    counters.advance(0.1, own_cores=1.0, other_cores=1.0)
    assert gov.tick() == 2  # within the interval: no look at all
    counters.advance(0.6, own_cores=1.0, other_cores=1.0)
    assert gov.tick() == 1 and applied == [1]
    counters.advance(0.6, own_cores=1.0, other_cores=0.0)
    assert gov.tick() == 1
    counters.advance(0.6, own_cores=1.0, other_cores=0.0)
    assert gov.tick() == 2 and applied == [1, 2] and gov.num_changes == 2


def test_the_first_window_starts_when_the_governor_is_built():
    counters, applied = _FakeCounters(), []
    gov = _governor(counters, applied)  # built beside a neighbour that is already busy
    counters.advance(0.6, own_cores=1.0, other_cores=1.0)
    assert gov.tick() == 2 and not applied  # the first step's look already has a window: seen once
    counters.advance(0.6, own_cores=1.0, other_cores=1.0)
    assert gov.tick() == 1 and applied == [1]


def test_the_first_look_applies_at_once():
    counters, applied = _FakeCounters(), []
    gov = _governor(counters, applied)  # built beside a neighbour that is already busy
    assert gov.first_look(0.2, sleep=lambda s: counters.advance(s, own_cores=0.0, other_cores=1.0)) == 1
    assert applied == [1] and gov.num_changes == 1
    counters.advance(0.6, own_cores=1.0, other_cores=1.0)
    assert gov.tick() == 1  # the next window starts where the first look ended


def test_a_first_look_at_an_idle_machine_changes_nothing():
    counters, applied = _FakeCounters(), []
    gov = _governor(counters, applied)
    assert gov.first_look(0.2, sleep=lambda s: counters.advance(s, own_cores=0.5, other_cores=0.0)) == 2
    assert not applied


def test_a_one_check_burst_changes_nothing():
    counters, applied = _FakeCounters(), []
    gov = _governor(counters, applied)
    gov.tick()
    counters.advance(0.6, own_cores=1.0, other_cores=1.0)
    gov.tick()
    counters.advance(0.6, own_cores=2.0, other_cores=0.0)
    assert gov.tick() == 2 and not applied


def test_real_counters_read_and_the_governor_is_only_automatic(monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    assert read_cpu_busy_ticks(cpus) > 0 and read_own_ticks() > 0
    monkeypatch.delenv("KVPAGE_NUM_THREADS", raising=False)
    monkeypatch.delenv("KVPAGE_THREAD_GOVERNOR", raising=False)
    assert governor_for(None, 2, lambda n: None) is not None
    assert governor_for(2, 2, lambda n: None) is None  # the user chose the count
    assert governor_for(None, 1, lambda n: None) is None  # nothing to lower
    monkeypatch.setenv("KVPAGE_THREAD_GOVERNOR", "0")
    assert governor_for(None, 2, lambda n: None) is None


def test_an_engine_ticks_its_governor_between_steps(monkeypatch):
    """With the governor on, the engine owns one, ticks it every step and reports its count."""
    from kvpage import LLM, SamplingParams
    from tiny_models import tiny_model

    monkeypatch.delenv("KVPAGE_NUM_THREADS", raising=False)
    monkeypatch.setenv("KVPAGE_THREAD_GOVERNOR", "1")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: nothing to lower, so no governor")
    llm = LLM(tiny_model("llama"), block_size=4, num_kv_blocks=32, max_model_len=64)
    try:
        gov = llm.engine.thread_governor
        assert gov is not None
        ticks = []
        monkeypatch.setattr(gov, "tick", lambda: ticks.append(1) or gov.current)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(ticks) >= 4 and llm.stats()["compute_threads"] == gov.current
    finally:
        llm.restore()


def test_counts_round_down_to_an_allowed_one():
    assert nearest_allowed(5, None) == 5
    assert nearest_allowed(5, (8, 7)) == 7  # below every allowed count: the smallest
    assert nearest_allowed(7, (8, 7)) == 7 and nearest_allowed(8, (8, 7)) == 8
    assert nearest_allowed(6, (2, 4, 8)) == 4


def test_a_governor_with_counts_only_moves_between_them():
    """A compiled engine's governor (8 threads, entries for 8 and 7): three busy cores
    elsewhere would ask for 5 threads, and it goes to 7."""
    counters, applied = _FakeCounters(), []
    gov = ThreadGovernor(8, applied.append, cpus=list(range(8)), interval_s=0.5, clock=lambda: counters.now,
                         read_busy=lambda cpus: counters.busy, read_own=lambda: counters.own, counts=(8, 7))
    gov._hz = 100
    for _ in range(2):
        counters.advance(0.6, own_cores=5.0, other_cores=3.0)
        gov.tick()
    assert applied == [7] and gov.current == 7
