"""Stateful fuzz of the scheduler over a tiny pool (constant memory pressure).

Random interleavings of add / step (a fake model sampling random tokens) / finish / abort /
fork / evict / misuse (bad input and protocol mistakes, which must be ValueErrors that
change nothing), for every combination of prefix caching, chunked prefill and policy, with
hybrid KV groups (a full-attention group and two sliding-window groups in one pool), and
with recurrent-state slots (a fake state per slot replays which tokens it has absorbed:
every step must find a resumed sequence's state covering exactly its computed tokens,
forks and preemptions included). After every rule the block and slot accounting must
balance; when the adds stop everything must drain and every block and slot must come back.
"""
from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvpage import CacheConfig, FinishReason, RequestStatus, SamplingParams, Scheduler, SchedulerConfig

BS = 4
NUM_BLOCKS = 10  # 40 token slots: a few requests already exhaust it
MAX_MODEL_LEN = 40
MAX_SEQS = 4
EOS = 0
STOP = 5
VOCAB = 8
MAX_LIVE = 10
DRAIN_STEPS = 3000
PREFIXES = ([1, 2, 3, 4], [1, 2, 3, 4, 6, 7, 1, 2], [3, 3, 3, 3, 3, 3])  # shared prompt heads for cache hits

EXAMPLES = 30
STEPS_PER_EXAMPLE = 60
HYBRID = (None, 8, 8)  # group 0 full, two sliding groups of an 8-token window (2 blocks)
HYBRID_NUM_BLOCKS = 18
CONFIGS = [(*c, (None,)) for c in itertools.product((True, False), (True, False), ("fcfs", "priority"))]
CONFIGS += [(prefix, chunked, "fcfs", HYBRID) for prefix, chunked in itertools.product((True, False), (True, False))]
STATE_CONFIGS = [(False, chunked, policy, (None,), True) for chunked in (True, False) for policy in ("fcfs", "priority")]
MIN_TOTAL_OPS = 10_000

totals = {"misuses": 0, "ops": 0, "steps": 0, "preemptions": 0, "hits": 0, "forks": 0, "copies": 0, "aborts": 0, "drained": 0,
          "state_resumes": 0, "state_copies": 0}


def machine_for(prefix: bool, chunked: bool, policy: str, windows: tuple = (None,), state: bool = False):
    num_blocks = NUM_BLOCKS if len(windows) == 1 else HYBRID_NUM_BLOCKS

    class SchedulerMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            budget = 16 if chunked else MAX_MODEL_LEN  # without chunking a prompt must fit whole
            self.s = Scheduler(
                CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=prefix,
                            group_windows=windows, num_state_slots=MAX_SEQS if state else 0),
                SchedulerConfig(
                    max_num_seqs=MAX_SEQS,
                    max_num_batched_tokens=budget,
                    max_model_len=MAX_MODEL_LEN,
                    enable_chunked_prefill=chunked,
                    policy=policy,
                    max_preemptions_before_pin=2,
                ),
            )
            self.ids = itertools.count()
            self.family: dict[str, str] = {}  # request id -> id of the request it was forked from (root)
            self.admitted: list = []
            self.rng = random.Random(0)
            self.states: dict[int, list[int]] = {}  # slot -> the tokens its fake state has absorbed
            self.last_out = None  # the last step output applied

        # ------------------------------------------------------------------ helpers
        def live(self) -> list[str]:
            return sorted(self.s.requests)

        def run_step(self, seed: int, misuse: str = "") -> None:
            """One step with random tokens; ``misuse`` first makes a protocol mistake
            (scheduling again before applying, bad sampled tokens, forks of a request that
            has none) that must be a ValueError and change nothing."""
            s = self.s
            running_before = {id(r) for r in s.running}
            out = s.schedule()
            meta = out.metadata
            budget = s.config.max_num_batched_tokens
            assert sum(out.num_new_tokens) == meta.num_tokens <= budget
            assert meta.num_seqs == len(out.requests) <= MAX_SEQS
            assert all(n > 0 for n in out.num_new_tokens)
            assert len({id(r) for r in out.requests}) == len(out.requests)
            for r in out.requests:
                assert r.status is RequestStatus.RUNNING
            for r in out.preempted:
                assert id(r) in running_before and r.status is RequestStatus.WAITING and not r.block_ids
                assert r not in out.requests
            if out.preempted:
                # Preempted requests wait at the head of the line (priority: ahead of any
                # request that ranks after them).
                head = s.waiting.peek()
                assert head is not None and head.sort_key <= min(r.sort_key for r in out.preempted)
            for g in range(len(windows)):
                slots = meta.for_group(g).slot_mapping.tolist()
                assert len(set(slots)) == len(slots), "two tokens of one step write the same KV slot"
                for i, r in enumerate(out.requests):  # slots follow the block tables
                    start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
                    assert r.released_blocks[g] <= r.num_computed_tokens // BS
                    for row in range(start, end):
                        p = int(meta.positions[row])
                        assert p == r.num_computed_tokens + row - start
                        assert p // BS >= r.released_blocks[g], "a new token's block left the window"
                        assert slots[row] == r.block_tables[g][p // BS] * BS + p % BS
            for src, dst in meta.block_copies.tolist():
                assert src != dst and any(dst in table for r in out.requests for table in r.block_tables)
            if state:
                self.check_state_step(out)
            totals["copies"] += len(meta.block_copies)
            totals["preemptions"] += len(out.preempted)
            totals["steps"] += 1
            rng = random.Random(seed)
            tokens = [rng.randrange(VOCAB) for _ in range(meta.sample_seq_indices.shape[0])]
            if misuse and out.requests:
                computed = [r.num_computed_tokens for r in out.requests]
                with pytest.raises(ValueError):
                    if misuse == "schedule again":
                        s.schedule()
                    elif misuse == "bad tokens":
                        s.update_from_output(out, [-1] + tokens[1:] if tokens else [3])
                    else:  # forks for a row whose request samples once (or a row that does not exist)
                        s.update_from_output(out, tokens, fork_token_ids={0: [1, 2]})
                assert [r.num_computed_tokens for r in out.requests] == computed
                totals["misuses"] += 1
            s.update_from_output(out, tokens)
            self.last_out = out

        def check_state_step(self, out) -> None:
            """Replay the step on fake states: forks' copies first, then each sequence
            resumes from a state covering exactly its computed tokens (or starts fresh)."""
            meta = out.metadata
            slots = meta.state_slots.tolist()
            assert len(slots) == meta.num_seqs and min(slots, default=0) >= 0 and len(set(slots)) == len(slots)
            for src, dst in meta.state_copies.tolist():
                self.states[dst] = list(self.states.get(src, []))
                totals["state_copies"] += 1
            for i, r in enumerate(out.requests):
                assert slots[i] == r.state_slot
                computed = int(meta.num_computed_tokens[i])
                if computed == 0:
                    self.states[slots[i]] = []
                else:
                    assert self.states.get(slots[i]) == r.all_token_ids[:computed], f"{r!r}: stale state"
                    totals["state_resumes"] += 1
                start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
                self.states[slots[i]] += meta.input_ids[start:end].tolist()

        def count_op(self) -> None:
            totals["ops"] += 1

        # ------------------------------------------------------------------ rules
        @precondition(lambda self: len(self.s.requests) < MAX_LIVE)
        @rule(
            head=st.sampled_from(PREFIXES + ([],)),
            tail=st.lists(st.integers(1, VOCAB - 1), max_size=24),
            max_tokens=st.integers(1, 16),
            priority=st.integers(0, 3),
            ignore_eos=st.booleans(),
            use_stop=st.booleans(),
        )
        def add(self, head, tail, max_tokens, priority, ignore_eos, use_stop):
            self.count_op()
            prompt = list(head) + tail or [1]
            rid = f"r{next(self.ids)}"
            sp = SamplingParams(
                max_tokens=max_tokens, priority=priority, ignore_eos=ignore_eos, stop_token_ids=[STOP] if use_stop else []
            )
            worst_kv = min(len(prompt) + max_tokens, MAX_MODEL_LEN) - 1
            held = self.s.kv.blocks_held(worst_kv, min(worst_kv, self.s.config.max_num_batched_tokens))
            fits = len(prompt) < MAX_MODEL_LEN and held <= num_blocks
            if not fits:
                with pytest.raises(ValueError):
                    self.s.make_request(rid, prompt, sp, eos_token_id=EOS)
                return
            req = self.s.make_request(rid, prompt, sp, eos_token_id=EOS)
            self.family[rid] = rid
            self.admitted.append(req)

        @rule(seed=st.integers(0, 2**31 - 1))
        def step(self, seed):
            self.count_op()
            self.run_step(seed)

        @rule(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 6))
        def steps(self, seed, n):
            self.count_op()
            for i in range(n):
                self.run_step(seed + i)

        @precondition(lambda self: self.s.requests)
        @rule(data=st.data())
        def finish(self, data):
            self.count_op()
            rid = data.draw(st.sampled_from(self.live()))
            r = self.s.finish_request(rid, FinishReason.STOP)
            assert r.is_finished and not r.block_ids and rid not in self.s.requests

        @precondition(lambda self: self.s.requests)
        @rule(data=st.data())
        def abort(self, data):
            self.count_op()
            rid = data.draw(st.sampled_from(self.live()))
            assert self.s.abort(rid) and not self.s.abort(rid)
            totals["aborts"] += 1

        @rule(kind=st.sampled_from(["token id", "namespace", "eos", "stale output", "reason"]))
        def misuse(self, kind):
            """Bad input and protocol mistakes are ValueErrors that change nothing (the
            invariants run after this rule as after any other)."""
            self.count_op()
            s, rid = self.s, f"x{next(self.ids)}"
            live = self.live()
            with pytest.raises(ValueError):
                if kind == "token id":
                    s.make_request(rid, [1, 2**63])
                elif kind == "namespace":
                    s.make_request(rid, [1, 2], None, None, ["unhashable"])
                elif kind == "eos":
                    s.make_request(rid, [1, 2], SamplingParams(max_tokens=1), eos_token_id=-1)
                elif kind == "stale output" and self.last_out is not None:
                    s.update_from_output(self.last_out, [1] * self.last_out.metadata.sample_seq_indices.shape[0])
                elif live:
                    s.finish_request(live[0], None)
                else:
                    raise ValueError("nothing to misuse")
            assert self.live() == live
            totals["misuses"] += 1

        @rule(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["schedule again", "bad tokens", "bad forks"]))
        def misused_step(self, seed, kind):
            self.count_op()
            self.run_step(seed, kind)

        @rule()
        def abort_unknown(self):
            self.count_op()
            assert not self.s.abort("no-such-request")

        @precondition(lambda self: self.s.running and len(self.s.running) < MAX_SEQS and len(self.s.requests) < MAX_LIVE)
        @rule(data=st.data())
        def fork(self, data):
            self.count_op()
            parent = data.draw(st.sampled_from(sorted(self.s.running, key=lambda r: r.request_id)))
            rid = f"f{next(self.ids)}"
            child = self.s.fork_request(parent.request_id, rid)
            assert child.block_ids == parent.block_ids and child.all_token_ids == parent.all_token_ids
            self.family[rid] = self.family[parent.request_id]
            self.admitted.append(child)
            totals["forks"] += 1

        @precondition(lambda self: self.s.prefix_cache is not None)
        @rule(k=st.integers(1, NUM_BLOCKS))
        def evict(self, k):
            self.count_op()
            pool = self.s.pool
            free_before, cached_before = pool.num_free_blocks, pool.num_cached_blocks
            evicted = self.s.prefix_cache.evict(k)
            # A node takes its other groups' blocks with it, so hybrid evictions may exceed k; a
            # sliding block adopted by a request that still holds it is uncached, not released.
            assert 0 <= evicted <= k * len(windows)
            uncached = cached_before - pool.num_cached_blocks
            assert uncached == evicted if len(windows) == 1 else uncached >= evicted
            assert pool.num_free_blocks == free_before  # idle cached blocks already counted as free

        # ------------------------------------------------------------------ invariants
        @invariant()
        def accounting_balances(self):
            s = self.s
            s.check_integrity()  # pool + cache + (holders == ref counts)
            pool = s.pool
            assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
            assert len(s.running) <= MAX_SEQS
            assert len(s.waiting) + len(s.running) == len(s.requests)
            holders: dict[int, set[str]] = {}
            for r in s.requests.values():
                assert r.status in (RequestStatus.WAITING, RequestStatus.RUNNING)
                assert len(r.block_ids) == -(-r.num_computed_tokens // BS) or r.num_computed_tokens == 0 == len(r.block_ids)
                for g, window in enumerate(windows):
                    held = r.held_blocks(g) if g < len(r.block_tables) else []
                    if window is not None and r.status is RequestStatus.RUNNING:
                        # Between steps a sliding group holds only its window's blocks.
                        assert len(held) <= -(-(window - 1) // BS) + 1, (r, g, held)
                    for b in held:
                        holders.setdefault(b, set()).add(r.request_id)
            for b, who in holders.items():
                if len(who) > 1 and not pool.is_cached(b):
                    assert len({self.family[w] for w in who}) == 1, f"block {b} shared by unrelated {who}"

        def teardown(self):
            s = self.s
            for _ in range(DRAIN_STEPS):
                if not s.has_unfinished_requests():
                    break
                self.run_step(self.rng.randrange(2**31))
                s.check_integrity()
            assert not s.has_unfinished_requests(), f"starved: {s.requests}"
            assert all(r.is_finished for r in self.admitted)
            assert s.pool.num_free_blocks == s.pool.num_blocks and s.pool.num_used_blocks == 0
            if s.state_slots is not None:
                assert s.state_slots.num_free == s.state_slots.num_slots and s.state_slots.num_used == 0
            if s.prefix_cache is not None:
                totals["hits"] += s.prefix_cache.num_hit_tokens
                s.prefix_cache.reset()
                assert s.pool.num_cached_blocks == 0
            s.check_integrity()
            totals["drained"] += 1

    SchedulerMachine.__name__ = f"Machine_prefix{prefix}_chunked{chunked}_{policy}_groups{len(windows)}_state{state}"
    return SchedulerMachine


def test_scheduler_state_machine_all_configs():
    cfg = settings(
        max_examples=EXAMPLES,
        stateful_step_count=STEPS_PER_EXAMPLE,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        derandomize=True,
        database=None,
    )
    for prefix, chunked, policy, windows in CONFIGS:
        run_state_machine_as_test(machine_for(prefix, chunked, policy, windows), settings=cfg)
    assert totals["ops"] >= MIN_TOTAL_OPS, totals
    # The fuzz must actually reach the interesting paths.
    assert totals["preemptions"] > 0 and totals["forks"] > 0 and totals["copies"] > 0, totals
    assert totals["hits"] > 0 and totals["aborts"] > 0 and totals["misuses"] > 0, totals
    assert totals["drained"] >= len(CONFIGS) * EXAMPLES // 2, totals


def test_scheduler_state_machine_with_state_slots():
    """Recurrent-state slots: prefix caching off (a cached block holds no state)."""
    cfg = settings(max_examples=EXAMPLES, stateful_step_count=STEPS_PER_EXAMPLE, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], derandomize=True,
                   database=None)
    before = dict(totals)
    for config in STATE_CONFIGS:
        run_state_machine_as_test(machine_for(*config), settings=cfg)
    grew = {key: totals[key] - before[key] for key in totals}
    assert grew["state_resumes"] > 0 and grew["state_copies"] > 0 and grew["preemptions"] > 0, grew
