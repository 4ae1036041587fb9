"""Soak: thousands of requests through ``AsyncLLM`` on a tiny model under KV pressure.

Random prompt lengths (some sharing cached prefixes), random sampling parameters, random
aborts (before the first token, mid-stream, from another coroutine), a few invalid requests
and an injected model fault every ``FAULT_EVERY`` steps. At the end every block is free,
``check_integrity`` passes and resident memory is flat after warm-up.

CI runs ``KVPAGE_SOAK_REQUESTS`` (default 300) requests. The long version:

    KVPAGE_SOAK_REQUESTS=5000 /tmp/venv/bin/pytest tests/test_soak.py -s
"""
from __future__ import annotations

import asyncio
import gc
import os
import random
import time
from collections import Counter

import pytest

from kvpage import LLM, SamplingParams
from kvpage.engine.async_llm import AsyncLLM
from kvpage.engine.outputs import RequestOutput
from test_faults import StepFaults, assert_no_leak
from test_faults import one_torch_thread  # noqa: F401 - an autouse fixture
from tiny_models import VOCAB, char_tokenizer, tiny_model

NUM_REQUESTS = int(os.environ.get("KVPAGE_SOAK_REQUESTS", "300"))
CONCURRENCY = 24
FAULT_EVERY = 41  # model steps; a prime, so faults land on every kind of step
MAX_MODEL_LEN = 64
REQUEST_TIMEOUT_S = 120.0
WARMUP_FRACTION = 0.2
# Allowed RSS growth after warm-up. The engine keeps no per-request state once a request
# ends, so growth is allocator noise; a leak of even 1 KiB per request would exceed this at 5000.
RSS_SLACK_KIB = 4096 if NUM_REQUESTS <= 1000 else 8192
PREFIXES = ["You are a helpful assistant. ", "Translate to French: ", "Q: "]
GREEDY_PROMPTS = [f"greedy prompt number {i}: " for i in range(8)]


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _random_request(rng: random.Random):
    """(prompt, params or None for a deliberately invalid request, abort plan, greedy key)."""
    roll = rng.random()
    if roll < 0.03:  # invalid: empty prompt, out-of-vocabulary id, or too long
        return rng.choice(["", [VOCAB + 5], "x" * MAX_MODEL_LEN]), SamplingParams(max_tokens=2), None, None
    max_tokens = rng.randint(1, 6)
    if roll < 0.25:  # greedy on a small prompt pool: outputs must agree with each other
        prompt = rng.choice(GREEDY_PROMPTS)
        return prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), None, prompt
    if rng.random() < 0.5:
        prompt = rng.choice(PREFIXES) + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(0, 30)))
    else:
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 40))]
    params = SamplingParams(n=rng.choice([1, 1, 1, 2]), max_tokens=max_tokens,
                            temperature=rng.choice([0.0, 0.7, 1.0, 1.5]), top_p=rng.choice([1.0, 0.9, 0.5]),
                            top_k=rng.choice([-1, 5, 40]), seed=rng.choice([None, rng.randrange(1 << 30)]),
                            repetition_penalty=rng.choice([1.0, 1.0, 1.2]), stop=rng.choice([None, ["a"], ["e", "x"]]),
                            logprobs=rng.choice([None, None, 0, 3]), ignore_eos=rng.random() < 0.5)
    abort = rng.choices([None, "now", "mid", "external"], weights=[80, 5, 10, 5])[0]
    return prompt, params, (abort, rng.randint(0, 3)), None


async def _client(engine: AsyncLLM, spec, ends: Counter, greedy: dict) -> None:
    prompt, params, plan, greedy_key = spec
    try:
        stream = await engine.add_request(prompt, params)
    except ValueError:
        ends["rejected"] += 1
        return
    abort, k = plan or (None, 0)
    if abort == "now":
        stream.abort()
        ends["aborted"] += 1
        return
    if abort == "external":
        async def later():
            for _ in range(k):
                await asyncio.sleep(0)
            await engine.abort(stream.request_id)

        asyncio.get_running_loop().create_task(later())
    final = None
    items = 0
    async for item in stream:
        items += 1
        if abort == "mid" and items > k:
            break  # the consumer leaves: the stream aborts the request
        if isinstance(item, RequestOutput):
            final = item
    if final is None or any(s.finish_reason == "abort" for s in final.outputs):
        ends["aborted"] += 1
        return
    reasons = {s.finish_reason for s in final.outputs}
    if "error" in reasons:
        assert all("injected fault" in s.error for s in final.outputs if s.error)
        ends["failed (injected)"] += 1
        return
    assert reasons <= {"stop", "length"} and len(final.outputs) == params.n
    for sample in final.outputs:
        assert 1 <= len(sample.token_ids) <= params.max_tokens
    if greedy_key is not None:  # a greedy output is a prefix of any longer one for the same prompt
        tokens = final.outputs[0].token_ids
        known = greedy.setdefault(greedy_key, tokens)
        short, long = sorted((known, tokens), key=len)
        assert long[: len(short)] == short, f"greedy outputs of {greedy_key!r} disagree"
        greedy[greedy_key] = long
    ends["done"] += 1


async def _drive(engine: AsyncLLM, specs, on_progress) -> tuple[Counter, dict]:
    ends: Counter = Counter()
    greedy: dict = {}
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i, spec):
        async with gate:
            await asyncio.wait_for(_client(engine, spec, ends, greedy), REQUEST_TIMEOUT_S)
        on_progress(i)

    await asyncio.gather(*(one(i, spec) for i, spec in enumerate(specs)))
    deadline = time.monotonic() + 60
    while True:  # aborts are asynchronous: wait until the engine has let go of everything
        stats = await asyncio.wait_for(engine.fresh_stats(), 30)
        if stats["num_running"] == stats["num_waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"the engine never went idle: {stats}"
        await asyncio.sleep(0.01)
    await asyncio.wait_for(asyncio.wrap_future(engine._call(engine.engine.check_integrity)), 30)
    return ends, greedy


@pytest.mark.slow
def test_soak_keeps_serving_and_loses_nothing():
    # 48 blocks of 4 = 192 token slots for up to 16 sequences of up to 64 tokens: preemption happens.
    llm = LLM(tiny_model("llama"), tokenizer=char_tokenizer(), block_size=4, num_kv_blocks=48, max_num_seqs=16,
              max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN)
    rng = random.Random(1234)
    specs = [_random_request(rng) for _ in range(NUM_REQUESTS)]
    warmup_at = int(NUM_REQUESTS * WARMUP_FRACTION)
    rss = {}

    def on_progress(i: int) -> None:
        if i == warmup_at:
            gc.collect()
            rss["warm"] = rss_kib()
        if i and i % 500 == 0:  # visible with -s: the rate must stay flat over a long run
            print(f"  {i} requests, {time.monotonic() - started:.1f} s, {faults.calls} steps, "
                  f"RSS {rss_kib()} KiB", flush=True)

    faults = StepFaults(llm.engine, raise_if=lambda step: step % FAULT_EVERY == 0, record=False)
    rss["start"] = rss_kib()
    started = time.monotonic()
    engine = AsyncLLM(llm.engine).start()
    try:
        with faults:
            ends, greedy = asyncio.run(_drive(engine, specs, on_progress))
        stats = llm.stats()
    finally:
        engine.shutdown()
        llm.restore()
    gc.collect()
    rss["end"] = rss_kib()
    elapsed = time.monotonic() - started
    assert_no_leak(llm.engine)
    print(f"\nsoak: {NUM_REQUESTS} requests in {elapsed:.1f} s, {dict(ends)}; {faults.calls} steps, "
          f"{stats['num_step_errors']} injected faults, {stats['num_preemptions']} preemptions, "
          f"{stats['num_thrash_pins']} thrash pins, prefix hits {stats['prefix_cache_hits']} tokens; "
          f"blocks free {stats['num_free_blocks']}/{stats['num_blocks']}; "
          f"RSS start {rss['start']} KiB, after warm-up {rss['warm']} KiB, end {rss['end']} KiB")
    assert sum(ends.values()) == NUM_REQUESTS
    assert ends["done"] > NUM_REQUESTS // 2 and ends["aborted"] and ends["rejected"]
    assert stats["num_step_errors"] >= 1 and stats["num_preemptions"] >= 1
    assert len(greedy) == len(GREEDY_PROMPTS)
    assert rss["end"] - rss["warm"] <= RSS_SLACK_KIB, rss
