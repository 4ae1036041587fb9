"""Scheduler step cost: ``schedule()`` (which builds the ``StepMetadata``) plus ``update_from_output``.

Run with::

    python -m pytest benchmarks/bench_scheduler.py --benchmark-only

Target: <= 1 ms per step for 256 running decode sequences (block_size 16, contexts of a
few hundred tokens) and for a mixed step (decodes plus a chunked prefill). The model is
not part of the measurement: sampled tokens are precomputed.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvpage import CacheConfig, SamplingParams, Scheduler, SchedulerConfig

pytest.importorskip("pytest_benchmark")

BLOCK_SIZE = 16
NUM_SEQS = 256
ROUNDS = 300  # steps measured per benchmark (each is one schedule + update)
EOS = 0  # never sampled below, so nothing stops early


def _step(scheduler: Scheduler, tokens: np.ndarray):
    out = scheduler.schedule()
    scheduler.update_from_output(out, tokens[: out.metadata.sample_seq_indices.shape[0]])
    return out


def _drain_prefills(scheduler: Scheduler, tokens: np.ndarray) -> None:
    """Step (untimed) until every request is past its prompt."""
    for _ in range(10_000):
        out = _step(scheduler, tokens)
        if out.metadata.num_decodes == len(out.requests) == NUM_SEQS:
            return
    raise AssertionError("prefill did not finish")


def test_decode_step_256_seqs(benchmark):
    """256 running decodes with 200-400 token contexts: one token each per step."""
    rng = np.random.default_rng(0)
    max_tokens = ROUNDS + 100
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_SEQS * ((400 + max_tokens) // BLOCK_SIZE + 2))
    sched = Scheduler(cache, SchedulerConfig(max_num_seqs=NUM_SEQS, max_num_batched_tokens=8192, max_model_len=4096))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(NUM_SEQS):
        prompt = rng.integers(1, 32_000, size=int(rng.integers(200, 401))).tolist()
        sched.make_request(f"r{i}", prompt, params, eos_token_id=EOS)
    tokens = rng.integers(1, 32_000, size=NUM_SEQS)
    _drain_prefills(sched, tokens)

    out = benchmark.pedantic(_step, args=(sched, tokens), rounds=ROUNDS, iterations=1, warmup_rounds=5)
    assert out.metadata.num_seqs == NUM_SEQS and out.metadata.num_decodes == NUM_SEQS
    assert sched.stats()["num_preemptions"] == 0


def test_mixed_prefill_decode_step(benchmark):
    """~240 running decodes plus chunked prefill of arriving 400-token prompts, 2048-token budget.

    Requests generate 48 tokens, so some finish and new ones are admitted every step; the
    setup (untimed) keeps a few prompts waiting so each step carries a prefill chunk.
    """
    rng = np.random.default_rng(1)
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_SEQS * (500 // BLOCK_SIZE + 2))
    sched = Scheduler(cache, SchedulerConfig(max_num_seqs=NUM_SEQS, max_num_batched_tokens=2048, max_model_len=4096))
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    ids = itertools.count()
    tokens = rng.integers(1, 32_000, size=NUM_SEQS)
    prompts = [rng.integers(1, 32_000, size=400).tolist() for _ in range(64)]

    def top_up():
        while sched.num_waiting < 4:
            i = next(ids)
            sched.make_request(f"m{i}", prompts[i % len(prompts)], params, eos_token_id=EOS)
        return (sched, tokens), {}

    for _ in range(400):  # reach a steady state (untimed)
        top_up()
        _step(sched, tokens)

    out = benchmark.pedantic(_step, setup=top_up, rounds=ROUNDS, iterations=1, warmup_rounds=5)
    meta = out.metadata
    assert 0 < meta.num_decodes < meta.num_seqs <= NUM_SEQS  # a real mix
    assert meta.num_tokens <= 2048
