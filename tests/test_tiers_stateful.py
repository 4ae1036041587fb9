"""Stateful fuzz of the tiered prefix cache: pool, host and disk, under constant pressure.

The real engine, scheduler, tier agent and disk store run over a tiny numpy KV pool; the
model is a fake (``TruthRunner``) that writes, for every token, K = (a rolling hash of
the token prefix, the position) and V = K + 1000, and before it returns checks every position each
sequence attends to. So a block stored to host, loaded back, saved to disk, read back or
copied on write that holds the wrong KV is caught on the step that would read it, whatever
path it took. Rules add requests over shared prefixes, step, abort, evict the pool, fail a
step or its tier copies, and corrupt disk files. After every rule the accounting balances:
free + used == total for the pool and for each tier.

The machine runs over every quantized KV format too (``kv_cache_dtype``): there a token's
K and V rows are bytes (codes in a block's codes region, scales in its scales region), and
the fake model writes a digest of the truth across both, so a block whose codes moved
without their scales, or the other way round, is caught as well.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvpage import CacheConfig, SamplingParams, Scheduler, SchedulerConfig
from kvpage.engine.llm_engine import LLMEngine
from kvpage.kernels.kv_quant import block_views
from kvpage.storage.paged_cache import PagedKVCache
from kvpage.storage.spec import KVCacheSpec
from kvpage.storage.tiers import disk_block_shape
from kvpage.engine.sampler import Sampler
from kvpage.storage.tiers.agent import KVTierAgent
from kvpage.storage.tiers.disk_store import DiskKVStore
from tiny_models import VOCAB, char_tokenizer

BS = 4
NUM_BLOCKS = 12
HOST_BLOCKS = 6
DISK_BLOCKS = 14
MAX_MODEL_LEN = 40
PREFIXES = ([5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20, 21, 22, 23, 24, 25, 26, 27], [30] * 12, [40, 41, 42, 43])
EXAMPLES = 60
STEPS_PER_EXAMPLE = 80
DRAIN_STEPS = 2000
SPEC = KVCacheSpec.uniform(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, dtype="float32")
QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")
QUANTIZED_EXAMPLES = 15  # per format

totals = {"host_loads": 0, "disk_loads": 0, "host_stores": 0, "disk_saves": 0, "corrupt": 0, "faults": 0,
          "drained": 0}


def prefix_truth(tokens: list[int]) -> np.ndarray:
    """Per position: a rolling hash of tokens[: p + 1], exact in float32 (< 2**23)."""
    out = np.empty(len(tokens), dtype=np.float32)
    h = 0
    for p, t in enumerate(tokens):
        h = (h * 31 + t + 1) % (1 << 23)
        out[p] = h
    return out


class TruthRunner:
    """A ``ModelRunner`` whose KV is the truth about each prefix; records every wrong read."""

    def __init__(self, kv: PagedKVCache, scheduler: Scheduler) -> None:
        self.kv, self.scheduler = kv, scheduler
        self.violations: list[str] = []
        self.fail_next = False
        fmt = kv.spec.kv_format
        if fmt.quantized:  # per buffer: (codes, scales) views [num_blocks, BS, heads, bytes]
            self.bufs = [block_views(buf, fmt, BS, 1, 2) for buf in (kv.key_cache(0), kv.value_cache(0))]
            self.code_bytes = fmt.code_bytes(2)
            self.row_bytes = fmt.row_bytes(2)
        else:
            self.bufs = [kv.key_cache(0).reshape(-1, 2), kv.value_cache(0).reshape(-1, 2)]

    def _as_stored(self, want: np.ndarray) -> np.ndarray:
        """The rows as the buffer holds them: the values, or per row a digest of them filling
        the row's codes and scales (every byte depends on the row)."""
        if not self.kv.spec.kv_format.quantized:
            return want
        return np.stack([np.frombuffer(hashlib.blake2b(row.tobytes(), digest_size=self.row_bytes).digest(),
                                       dtype=np.uint8) for row in want])

    def _write(self, buf, slots: np.ndarray, rows: np.ndarray) -> None:
        if not self.kv.spec.kv_format.quantized:
            buf[slots] = rows
            return
        codes, scales = buf
        blocks, offsets = slots // BS, slots % BS
        codes[blocks, offsets, 0] = rows[:, : self.code_bytes]
        scales[blocks, offsets, 0] = rows[:, self.code_bytes:]

    def _read(self, buf, slots: np.ndarray) -> np.ndarray:
        if not self.kv.spec.kv_format.quantized:
            return buf[slots]
        codes, scales = buf
        blocks, offsets = slots // BS, slots % BS
        return np.concatenate([codes[blocks, offsets, 0], scales[blocks, offsets, 0]], axis=1)

    def execute(self, metadata):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected step fault")
        if len(metadata.block_copies):
            self.kv.copy_blocks(metadata.block_copies)
        bufs = self.bufs
        seqs = []
        for i, rid in enumerate(metadata.request_ids):
            tokens = self.scheduler.requests[rid].all_token_ids
            ctx, start = int(metadata.seq_lens[i]), int(metadata.num_computed_tokens[i])
            pos = np.arange(ctx)
            slots = metadata.block_tables[i][pos // BS].astype(np.int64) * BS + pos % BS
            key = np.stack([prefix_truth(tokens[:ctx]), pos.astype(np.float32)], axis=1)
            wants = tuple(map(self._as_stored, (key, key + np.float32(1000))))  # V differs from K: a swap shows
            for buf, want in zip(bufs, wants):  # every layer writes the step's KV before anyone attends
                self._write(buf, slots[start:], want[start:])
            seqs.append((rid, slots, wants))
        for rid, slots, wants in seqs:
            for buf, want in zip(bufs, wants):
                got = self._read(buf, slots)
                if not np.array_equal(got, want):
                    bad = int(np.flatnonzero((got != want).any(axis=1))[0])
                    self.violations.append(f"{rid}: wrong KV at position {bad}")
        # Logits depend on the tokens only: the output is the same whatever was cached.
        logits = torch.zeros(len(metadata.logits_indices), VOCAB)
        rows = metadata.logits_indices.tolist()
        for j, row in enumerate(rows):
            seq = int(np.searchsorted(metadata.query_start_loc, row, side="right") - 1)
            tokens = self.scheduler.requests[metadata.request_ids[seq]].all_token_ids
            logits[j, 3 + (sum(tokens[-3:]) % (VOCAB - 3))] = 10.0
        return logits


class TieredMachine(RuleBasedStateMachine):
    spec = SPEC

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        cache = CacheConfig(BS, NUM_BLOCKS, True, HOST_BLOCKS, DISK_BLOCKS)
        self.s = Scheduler(cache, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12,
                                                  max_model_len=MAX_MODEL_LEN, max_preemptions_before_pin=2))
        self.kv = PagedKVCache(self.spec, NUM_BLOCKS, backend="numpy")
        self.runner = TruthRunner(self.kv, self.s)
        dtype = torch.uint8 if self.spec.kv_format.quantized else torch.float32
        self.disk = DiskKVStore(self.dir.name, "f" * 64, disk_block_shape(self.spec), dtype)
        assert self.disk.open() == (True, None)
        self.engine = LLMEngine(self.runner, Sampler(0), char_tokenizer(), self.s, VOCAB,
                                kv_tiers=KVTierAgent(self.kv, HOST_BLOCKS, self.disk, disk_writable=True))
        self.ids = itertools.count()
        self.history: list[list[int]] = []  # finished conversations, to send again with a new turn

    def teardown(self) -> None:
        try:
            for _ in range(DRAIN_STEPS):
                if not self.engine.has_unfinished_requests():
                    break
                self.engine.step()
                self.engine.kv_tiers.flush()
            assert not self.engine.has_unfinished_requests(), "requests never finished"
            agent = self.engine.kv_tiers
            assert agent.flush()
            self.engine.step()  # takes the last completions
            self.check_accounting()
            assert self.s.pool.num_free_blocks == NUM_BLOCKS
            stats = self.s.stats()
            for key in ("host_loads", "disk_loads", "host_stores", "disk_saves"):
                totals[key] += stats[f"kv_{key}"]
            totals["drained"] += 1
        finally:
            self.engine.close()
            self.dir.cleanup()

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.engine.outputs.states) < 8)
    @rule(head=st.sampled_from(PREFIXES), tail=st.lists(st.integers(3, VOCAB - 1), max_size=10),
          max_tokens=st.integers(1, 8), n=st.sampled_from([1, 1, 1, 2]))
    def add(self, head, tail, max_tokens, n):
        prompt = list(head) + tail
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, n=n)
        self.engine.add_request(prompt, params, request_id=f"r{next(self.ids)}")

    @precondition(lambda self: self.history and len(self.engine.outputs.states) < 8)
    @rule(data=st.data(), tail=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=6),
          max_tokens=st.integers(1, 6))
    def resend_history(self, data, tail, max_tokens):
        """A later turn: an earlier conversation (prompt and output) plus a new message."""
        history = data.draw(st.sampled_from(self.history))
        prompt = (history + tail)[: MAX_MODEL_LEN - max_tokens - 1]
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.engine.add_request(prompt, params, request_id=f"r{next(self.ids)}")

    @rule(count=st.integers(1, 8), data=st.data(),
          fault=st.sampled_from([None] * 10 + ["step", "copies", "flip", "truncate", "garbage"]))
    def step(self, count, data, fault):
        """Steps. Before them a fault may be armed: the model step raises, the tier copies land
        but report failure, or a disk file is damaged (see ``corrupt_a_file``)."""
        if fault == "step":
            self.runner.fail_next = True
        elif fault == "copies":
            self.fail_next_copies()
        elif fault is not None:
            self.corrupt_a_file(data, fault)
        totals["faults"] += fault is not None
        for _ in range(count):
            self.engine.step()
            # Disk I/O runs on threads: wait for it, so the next step sees every completion
            # and the run is reproducible (hypothesis replays and shrinks it).
            assert self.engine.kv_tiers.flush()
            for output in self.engine.take_finished().values():
                for sample in output.outputs:
                    self.history.append(list(output.prompt_token_ids) + list(sample.token_ids))
        del self.history[:-12]

    def fail_next_copies(self):
        agent = self.engine.kv_tiers
        real = agent.before_step

        def failing(transfers):
            agent.before_step = real
            real(transfers)
            if transfers is not None and (len(transfers.host_stores) or len(transfers.host_loads)):
                raise OSError("injected copy fault")

        agent.before_step = failing

    @precondition(lambda self: self.engine.outputs.states)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.engine.outputs.states)))
        assert self.engine.abort(rid)

    @rule(k=st.integers(1, NUM_BLOCKS))
    def evict_pool(self, k):
        self.s.prefix_cache.evict(k)

    def corrupt_a_file(self, data, how):
        self.engine.kv_tiers.flush()
        names = sorted(os.listdir(self.disk.dir))
        if not names:
            return
        path = os.path.join(self.disk.dir, data.draw(st.sampled_from(names)))
        raw = bytearray(open(path, "rb").read())
        if how == "flip":
            raw[-3] ^= 0xFF  # inside the tensor data: only the checksum notices
        elif how == "truncate":
            raw = raw[: len(raw) // 2]
        else:
            raw[:16] = b"\xff" * 16
        with open(path, "wb") as handle:
            handle.write(bytes(raw))
        totals["corrupt"] += 1

    # ------------------------------------------------------------------ invariants
    @invariant()
    def no_wrong_kv_was_read(self):
        assert not self.runner.violations, self.runner.violations[:3]

    @invariant()
    def accounting_balances(self):
        self.check_accounting()

    def check_accounting(self):
        s = self.s
        s.check_integrity()
        assert s.pool.num_free_blocks + s.pool.num_used_blocks == s.pool.num_blocks
        for tier in (s.offload.host, s.offload.disk):
            assert tier.num_free_slots + tier.num_used_slots == tier.num_slots
            assert tier.num_used_slots <= tier.num_slots


def _run(machine, examples: int) -> None:
    totals.update(dict.fromkeys(totals, 0))
    cfg = settings(max_examples=examples, stateful_step_count=STEPS_PER_EXAMPLE, deadline=None, derandomize=True,
                   database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    run_state_machine_as_test(machine, settings=cfg)
    # The fuzz must reach every transfer path.
    assert totals["host_stores"] and totals["host_loads"] and totals["disk_saves"] and totals["disk_loads"], totals
    assert totals["drained"] >= examples // 2, totals


def test_tiered_cache_state_machine():
    _run(TieredMachine, EXAMPLES)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_tiered_cache_state_machine_over_quantized_blocks(kv_cache_dtype):
    class QuantizedMachine(TieredMachine):
        spec = KVCacheSpec.uniform(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, dtype="float32",
                                   kv_cache_dtype=kv_cache_dtype)

    _run(QuantizedMachine, QUANTIZED_EXAMPLES)
