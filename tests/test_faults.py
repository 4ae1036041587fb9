"""Fault injection, KV pressure and abort storms: keep serving, lose nothing.

Faults are injected by wrapping ``engine.runner.execute`` (``StepFaults``): raise on chosen
model steps, return NaN logits for one row, or return a wrong shape. Each test checks that
only the requests of the faulted step (or row) end with ``finish_reason == "error"`` and the
message, that every other request's greedy output equals a fault-free run, that later
requests still complete, and that no KV block leaks. Paths: ``LLM``, ``AsyncLLM`` and a
live in-process server (``build_app`` + uvicorn on a loopback thread; no production hook).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from typing import Callable, Optional

import httpx
import pytest
import torch

from kvpage import LLM, SamplingParams
from kvpage.engine.async_llm import AsyncLLM
from tiny_models import char_tokenizer, tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = ["a fairly long first prompt here", "second", "the third prompt", "4th", "fifth one!", "six"]
MAX_STEPS = 2000  # far above any run here: hitting it means the engine stopped making progress


class StepFaults:
    """Wraps an engine's runner and scheduler to inject faults into chosen model steps.

    ``raise_on``: 1-based step numbers (counted from arming) whose ``execute`` raises.
    ``nan_row``: ``(step, row)`` whose logits row becomes NaN. ``bad_shape_on``: steps that
    return one row too few. ``members[k]`` records the request ids of step ``k``; ``rows[k]``
    the request id of each logits row (unless ``record`` is off). Use as a context manager;
    it always disarms.
    """

    def __init__(self, engine, raise_on=(), nan_row: Optional[tuple[int, int]] = None, bad_shape_on=(),
                 raise_if: Optional[Callable[[int], bool]] = None, record: bool = True) -> None:
        self.engine = engine
        self.record = record  # off for long runs: the per-step records would grow memory
        self.raise_on, self.bad_shape_on, self.nan_row = set(raise_on), set(bad_shape_on), nan_row
        self.raise_if = raise_if
        self.calls = 0
        self.members: dict[int, set[str]] = {}
        self.rows: dict[int, list[str]] = {}
        self._last = None

    def __enter__(self) -> "StepFaults":
        runner, scheduler = self.engine.runner, self.engine.scheduler
        real_execute, real_schedule = runner.execute, scheduler.schedule

        def schedule():
            self._last = real_schedule()
            return self._last

        def execute(metadata):
            self.calls += 1
            k, out = self.calls, self._last
            if self.record:
                self.members[k] = {r.request_id for r in out.requests}
                self.rows[k] = [out.requests[i].request_id for i in metadata.sample_seq_indices.tolist()]
            if k in self.raise_on or (self.raise_if is not None and self.raise_if(k)):
                raise RuntimeError(f"injected fault at step {k}")
            logits = real_execute(metadata)
            if k in self.bad_shape_on:
                return logits[:-1]
            if self.nan_row is not None and self.nan_row[0] == k:
                logits = logits.clone()
                logits[self.nan_row[1]] = float("nan")
            return logits

        runner.execute, scheduler.schedule = execute, schedule  # instance attributes shadow the methods
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.runner.execute, self.engine.scheduler.schedule


def group_of(seq_id: str) -> str:
    return seq_id.split("#")[0]


def assert_no_leak(engine) -> None:
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def drain(engine) -> dict:
    """Step until nothing is left (at most MAX_STEPS); return the finished outputs by id."""
    finals = {}
    for _ in range(MAX_STEPS):
        engine.step()
        finals.update(engine.take_finished())
        if not engine.has_unfinished_requests():
            break
    return finals


def bounded_generate(llm: LLM, prompts, params=GREEDY):
    """``llm.generate`` that fails the test instead of hanging if steps stop finishing requests."""
    engine, real_step = llm.engine, llm.engine.step
    count = [0]

    def step():
        count[0] += 1
        assert count[0] <= MAX_STEPS, "the engine stopped making progress"
        return real_step()

    engine.step = step
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.step


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models on a shared 2-core machine run several times faster single-threaded
    (no OpenMP spin-waits against other processes); restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm():
    # max_num_seqs=3: some requests wait while others run, so a fault never covers them all.
    engine = LLM(tiny_model("llama"), tokenizer=char_tokenizer(), block_size=4, num_kv_blocks=64, max_num_seqs=3,
                 max_num_batched_tokens=16, max_model_len=96)
    yield engine
    engine.restore()


@pytest.fixture
def fresh(llm):
    """The shared engine with an empty prefix cache, so every test starts cold."""
    llm.engine.scheduler.prefix_cache.reset()
    return llm


@pytest.fixture(scope="module")
def expected(llm):
    llm.engine.scheduler.prefix_cache.reset()
    return [o.outputs[0].token_ids for o in bounded_generate(llm, PROMPTS)]


# ---------------------------------------------------------------------- LLM: step faults
@pytest.mark.parametrize("fault_step", [1, 2, 5, 9])  # first prefill chunk, mid-chunk, mixed, decode
def test_step_fault_fails_only_that_steps_requests(fresh, expected, fault_step):
    errors_before = fresh.stats()["num_step_errors"]
    with StepFaults(fresh.engine, raise_on=[fault_step]) as faults:
        outs = bounded_generate(fresh, PROMPTS)
    hit = {group_of(s) for s in faults.members[fault_step]}
    assert hit and len(hit) < len(PROMPTS)
    for out, want in zip(outs, expected):
        sample = out.outputs[0]
        if out.request_id in hit:
            assert sample.finish_reason == "error"
            assert f"injected fault at step {fault_step}" in sample.error
        else:
            assert (sample.finish_reason, sample.error, sample.token_ids) == ("length", None, want)
    assert fresh.stats()["num_step_errors"] == errors_before + 1
    assert_no_leak(fresh.engine)
    # Later requests, including those sharing prefixes with the failed ones, are exact.
    assert [o.outputs[0].token_ids for o in bounded_generate(fresh, PROMPTS)] == expected
    assert_no_leak(fresh.engine)


def test_nan_logits_fail_only_that_row(fresh, expected):
    with StepFaults(fresh.engine, nan_row=(4, 0)) as faults:
        outs = bounded_generate(fresh, PROMPTS)
    victim = group_of(faults.rows[4][0])
    assert len(faults.members[4]) > 1  # others ran in that very step
    for out, want in zip(outs, expected):
        sample = out.outputs[0]
        if out.request_id == victim:
            assert sample.finish_reason == "error" and "non-finite logits" in sample.error
        else:
            assert (sample.finish_reason, sample.token_ids) == ("length", want)
    assert_no_leak(fresh.engine)


def test_wrong_logits_shape_is_a_step_fault(fresh, expected):
    with StepFaults(fresh.engine, bad_shape_on=[3]) as faults:
        outs = bounded_generate(fresh, PROMPTS)
    hit = {group_of(s) for s in faults.members[3]}
    for out, want in zip(outs, expected):
        sample = out.outputs[0]
        if out.request_id in hit:
            assert sample.finish_reason == "error" and "shape" in sample.error
        else:
            assert sample.token_ids == want
    assert_no_leak(fresh.engine)


def test_a_row_the_sampler_cannot_draw_fails_alone(fresh, expected):
    """A sampler exception (e.g. one request's parameters overflow) fails only that request."""
    engine, real = fresh.engine, fresh.engine.sampler.sample
    poisoned = "2"  # engine ids count up from 0; PROMPTS[2] gets "2" in a fresh id space

    def sample(logits, requests):
        if any(group_of(r.request_id) == poisoned for r in requests):
            raise RuntimeError("probability tensor contains inf")
        return real(logits, requests)

    engine.sampler.sample = sample
    try:
        ids = [engine.add_request(p, GREEDY, request_id=str(i)) for i, p in enumerate(PROMPTS)]
        finals = drain(engine)
    finally:
        del engine.sampler.sample
    for rid, want in zip(ids, expected):
        sample = finals[rid].outputs[0]
        if rid == poisoned:
            assert sample.finish_reason == "error" and "sampling failed" in sample.error
        else:
            assert (sample.finish_reason, sample.token_ids) == ("length", want)
    assert_no_leak(engine)


def test_failed_prefill_leaves_no_stale_prefix_cache(fresh):
    shared = "a shared system prompt that spans several blocks: "
    prompts = [shared + "one", shared + "two"]
    want = [o.outputs[0].token_ids for o in bounded_generate(fresh, prompts)]
    fresh.engine.scheduler.prefix_cache.reset()
    with StepFaults(fresh.engine, raise_on=[1, 2, 3]):  # the whole shared prefill fails
        failed = bounded_generate(fresh, prompts[:1])
    assert failed[0].outputs[0].finish_reason == "error"
    assert fresh.stats()["num_cached_blocks"] == 0  # its blocks were never written: forgotten
    assert [o.outputs[0].token_ids for o in bounded_generate(fresh, prompts)] == want
    assert_no_leak(fresh.engine)


def test_parallel_samples_failing_before_their_first_token_all_end(fresh):
    params = SamplingParams(n=3, max_tokens=4, temperature=0.8, seed=7)
    with StepFaults(fresh.engine, raise_on=[1]):
        (out,) = bounded_generate(fresh, ["fork me"], params)  # hung forever before the fix
    assert [s.finish_reason for s in out.outputs] == ["error"] * 3
    assert all("injected" in s.error for s in out.outputs) and out.finished
    with StepFaults(fresh.engine, nan_row=(1, 0)):
        (out,) = bounded_generate(fresh, ["fork me"], params)
    assert [s.finish_reason for s in out.outputs] == ["error"] * 3
    (out,) = bounded_generate(fresh, ["fork me"], params)
    assert [len(s.token_ids) for s in out.outputs] == [4, 4, 4]
    assert_no_leak(fresh.engine)


def test_every_step_failing_still_ends_every_request(fresh, expected):
    with StepFaults(fresh.engine, raise_if=lambda k: True):
        outs = bounded_generate(fresh, PROMPTS)
    assert all(o.outputs[0].finish_reason == "error" for o in outs)
    assert_no_leak(fresh.engine)
    assert [o.outputs[0].token_ids for o in bounded_generate(fresh, PROMPTS)] == expected


# ---------------------------------------------------------------------- AsyncLLM
async def _collect(engine: AsyncLLM, prompt, params, timeout_s: float = 60.0):
    async def run():
        final = None
        async for item in engine.generate(prompt, params):
            final = item
        return final

    return await asyncio.wait_for(run(), timeout_s)


def test_async_engine_survives_a_step_fault(fresh, expected):
    engine = AsyncLLM(fresh.engine).start()
    try:
        with StepFaults(fresh.engine, raise_on=[3]) as faults:
            async def main():
                return await asyncio.gather(*(_collect(engine, p, GREEDY) for p in PROMPTS))

            outs = asyncio.run(main())
        hit = {group_of(s) for s in faults.members[3]}
        assert hit and len(hit) < len(PROMPTS)
        for out, want in zip(outs, expected):
            sample = out.outputs[0]
            if out.request_id in hit:
                assert sample.finish_reason == "error" and "injected fault at step 3" in sample.error
            else:
                assert sample.token_ids == want
        assert engine.is_running
        later = asyncio.run(_collect(engine, PROMPTS[0], GREEDY))
        assert later.outputs[0].token_ids == expected[0]
        stats = asyncio.run(asyncio.wait_for(engine.fresh_stats(), 30))
        assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_running"] == 0
    finally:
        engine.shutdown()
    assert_no_leak(fresh.engine)


# ---------------------------------------------------------------------- live server
class _LiveServer:
    """``build_app`` served by uvicorn on a thread, on a free loopback port."""

    def __init__(self, llm: LLM) -> None:
        import uvicorn

        from kvpage.entrypoints.openai.app import build_app
        from server_process import free_port

        self.engine = AsyncLLM(llm.engine).start()
        app = build_app(self.engine, llm.tokenizer, ["tiny"], llm.max_model_len,
                        max_tokens_cap=32, max_body_bytes=8192)
        self.base = f"http://127.0.0.1:{free_port()}"
        port = int(self.base.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        return self.base

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()  # the lifespan already did; this is a no-op then


def test_live_server_fails_only_the_faulted_request(fresh):
    body = {"model": "tiny", "prompt": "hello server", "max_tokens": 5, "temperature": 0}
    with _LiveServer(fresh) as base, httpx.Client(base_url=base, timeout=60) as http:
        good = http.post("/v1/completions", json=body)
        assert good.status_code == 200
        with StepFaults(fresh.engine, raise_on=[1]):
            failed = http.post("/v1/completions", json=body)
        assert failed.status_code == 500
        assert failed.json()["error"]["code"] == "generation_error"
        assert "injected fault" in failed.json()["error"]["message"]
        with StepFaults(fresh.engine, raise_on=[2]):
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                assert stream.status_code == 200
                events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        payloads = [json.loads(e) for e in events[:-1]]
        assert any("error" in p and "injected fault" in p["error"]["message"] for p in payloads)
        again = http.post("/v1/completions", json=body)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == good.json()["choices"][0]["text"]
        assert http.get("/health").status_code == 200
        # Resource bounds hold while faults happen: max_tokens and body size are capped.
        capped = http.post("/v1/completions", json={**body, "max_tokens": 33})
        assert capped.status_code == 400 and "cap" in capped.json()["error"]["message"]
        assert http.post("/v1/completions", json={**body, "prompt": "x" * 9000}).status_code == 413
        # The engine thread refreshes the stats the gauges read after each loop iteration, so
        # the last response can arrive a moment before the gauge drops: poll briefly.
        deadline = time.monotonic() + 5
        while "kvpage:num_requests_running 0.0" not in http.get("/metrics").text:
            assert time.monotonic() < deadline, "num_requests_running never returned to 0"
            time.sleep(0.02)
    assert_no_leak(fresh.engine)


# ---------------------------------------------------------------------- KV pressure
def test_kv_pressure_is_exact_pins_thrashers_and_finishes_in_bounded_steps():
    from prometheus_client import generate_latest

    from kvpage.entrypoints.openai.metrics import ServerMetrics

    model = tiny_model("llama")
    prompts = [[5 + i] * 8 for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = LLM(model, block_size=4, num_kv_blocks=128, max_num_batched_tokens=16, max_model_len=48)
    want = [o.outputs[0].token_ids for o in bounded_generate(roomy, prompts, params)]
    roomy.restore()
    # 12 blocks hold 48 tokens; each request needs up to 8 blocks: constant preemption.
    tight = LLM(model, block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, max_model_len=48)
    try:
        outs = bounded_generate(tight, prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == want
        stats = tight.stats()
        assert stats["num_preemptions"] > len(prompts) and stats["num_thrash_pins"] >= 1
        pin_after = tight.engine.scheduler.config.max_preemptions_before_pin
        assert max(o.metrics.num_preemptions for o in outs) <= pin_after  # pinned ones were spared
        serial_steps = sum(1 + params.max_tokens for _ in prompts)  # one at a time, no batching at all
        assert stats["num_steps"] <= serial_steps
        exposed = generate_latest(ServerMetrics(tight.stats).registry).decode()
        assert f"kvpage:num_thrash_pins_total {float(stats['num_thrash_pins'])}" in exposed
        assert_no_leak(tight.engine)
        with pytest.raises(ValueError, match="max_model_len"):  # can never fit: refused up front
            tight.generate([[7] * 8, [7] * 48], SamplingParams(max_tokens=1), use_tqdm=False)
        assert_no_leak(tight.engine)  # ... and the batch's valid prompt was not left queued
    finally:
        tight.restore()


def test_a_request_larger_than_the_pool_is_refused_up_front():
    # LLM sizes the pool to hold one max_model_len request; a bare Scheduler may be smaller.
    from kvpage import CacheConfig, Scheduler, SchedulerConfig

    scheduler = Scheduler(CacheConfig(block_size=4, num_blocks=12), SchedulerConfig(max_model_len=96))
    with pytest.raises(ValueError, match="blocks"):  # up to 59 KV tokens need 15 blocks > 12
        scheduler.make_request("big", [7] * 40, SamplingParams(max_tokens=20))
    scheduler.make_request("fits", [7] * 40, SamplingParams(max_tokens=8))
    assert list(scheduler.requests) == ["fits"]


def test_a_full_waiting_queue_refuses_cleanly_and_keeps_serving(fresh, expected):
    from kvpage.core.sched.output import QueueFullError

    engine, scheduler = fresh.engine, fresh.engine.scheduler
    original = scheduler.config
    scheduler.config = dataclasses.replace(original, max_waiting=2)
    try:
        ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
        with pytest.raises(QueueFullError, match="retry later"):
            engine.add_request(PROMPTS[2], GREEDY)
        finals = drain(engine)
    finally:
        scheduler.config = original
    assert [finals[rid].outputs[0].token_ids for rid in ids] == expected[:2]
    assert_no_leak(engine)


# ---------------------------------------------------------------------- abort storms
def _state(engine, rid: str) -> str:
    request = engine.scheduler.requests[rid]
    if request.num_output_tokens:
        return "decode"
    return "prefill" if request.num_computed_tokens else "queued"


def _abort_checked(engine, rid: str) -> None:
    """Abort ``rid`` and check that exactly the blocks only it referenced became free."""
    pool = engine.scheduler.pool
    own = sum(1 for b in engine.scheduler.requests[rid].block_ids if pool.ref_count(b) == 1)
    free_before = pool.num_free_blocks
    assert engine.abort(rid)
    assert pool.num_free_blocks - free_before == own
    engine.check_integrity()


def test_abort_storm_frees_exactly_the_aborted_blocks(fresh):
    """Abort requests queued, mid-prefill (between chunks), mid-decode and while their step
    runs, several sharing a cached prefix with survivors: survivors equal a run without aborts."""
    engine = fresh.engine
    shared = "shared prefix spanning blocks, "
    tails = ("keep", "drop mid-prefill", "keep too", "drop in decode", "drop queued", "drop mid-step", "kept")
    prompts = [shared + t for t in tails]
    want = [o.outputs[0].token_ids for o in bounded_generate(fresh, prompts)]
    engine.scheduler.prefix_cache.reset()
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    plan = {ids[1]: "prefill", ids[3]: "decode", ids[4]: "queued"}
    mid_step, aborted = ids[5], []

    with StepFaults(engine) as faults:
        real = engine.runner.execute

        def execute(metadata):  # a client that disconnects while the model runs
            logits = real(metadata)
            if mid_step in faults.members[faults.calls] and engine.has_request(mid_step):
                _abort_checked(engine, mid_step)
                aborted.append(mid_step)
            return logits

        engine.runner.execute = execute
        finals = {}
        for _ in range(MAX_STEPS):
            for rid, state in plan.items():
                if engine.has_request(rid) and _state(engine, rid) == state:
                    _abort_checked(engine, rid)
                    aborted.append(rid)
            engine.step()
            finals.update(engine.take_finished())
            if not engine.has_unfinished_requests():
                break
    assert sorted(aborted) == sorted([*plan, mid_step])  # each was caught in its planned state
    for i, rid in enumerate(ids):
        if rid in aborted:
            assert rid not in finals
        else:
            assert finals[rid].outputs[0].token_ids == want[i]
    assert_no_leak(engine)
