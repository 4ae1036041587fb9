"""Per-request deadlines in ``AsyncLLM``: past ``timeout_s`` a request ends with "length",
keeps what it generated and frees its blocks, whether it runs or waits."""
from __future__ import annotations

import asyncio
import time

import pytest

from kvpage import LLM, AsyncLLM, SamplingParams
from kvpage.engine.outputs import RequestOutput
from tiny_models import tiny_model

LONG = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(tiny_model("llama"), block_size=4, num_kv_blocks=128, max_model_len=256, max_num_seqs=1)
    yield llm
    llm.restore()


@pytest.fixture
def engine(llm):
    async_llm = AsyncLLM(llm.engine).start()
    async_llm.observers.append(lambda deltas, finished: time.sleep(0.004))  # >= 0.6 s for 150 tokens
    yield async_llm
    async_llm.shutdown()
    scheduler = llm.engine.scheduler
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks
    scheduler.check_integrity()


async def final_of(stream) -> RequestOutput:
    async for item in stream:
        if isinstance(item, RequestOutput):
            return item
    raise AssertionError("no final output")


def test_running_and_waiting_requests_expire(engine):
    async def run():
        running = await engine.add_request([5, 6, 7], LONG, timeout_s=0.2)
        waiting = await engine.add_request([8, 9], LONG, timeout_s=0.1)  # max_num_seqs=1: it waits
        return await asyncio.wait_for(asyncio.gather(final_of(running), final_of(waiting)), 30)

    started = time.monotonic()
    running, waiting = asyncio.run(run())
    assert time.monotonic() - started < 0.6
    assert running.outputs[0].finish_reason == "length" and 0 < len(running.outputs[0].token_ids) < 150
    assert waiting.outputs[0].finish_reason == "length" and waiting.outputs[0].token_ids == []


def test_a_reused_id_is_not_expired_by_the_old_deadline(engine):
    async def run():
        first = await engine.add_request([5, 6], SamplingParams(max_tokens=2, temperature=0), "same", timeout_s=0.3)
        await final_of(first)
        second = await engine.add_request([5, 6], SamplingParams(max_tokens=120, temperature=0, ignore_eos=True),
                                          "same")
        return await asyncio.wait_for(final_of(second), 60)

    out = asyncio.run(run())
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 120


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan")])
def test_bad_timeouts_are_refused(engine, timeout_s):
    async def run():
        await engine.add_request([5, 6], SamplingParams(max_tokens=2), timeout_s=timeout_s)

    with pytest.raises(ValueError, match="timeout"):
        asyncio.run(run())
