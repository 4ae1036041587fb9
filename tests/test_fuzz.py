"""Hypothesis fuzz of ``LLM.generate`` and ``AsyncLLM``: random prompts (empty, out of
vocabulary, too long, wrongly typed), random sampling parameters (many invalid) and random
aborts at any moment.

The only outcomes allowed are a valid output or ``ValueError``: never a hang (every run is
step- or time-bounded), another exception, or a leaked block. Examples are derandomized
and bounded, so CI sees the same cases every run.
"""
from __future__ import annotations

import asyncio
import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpage import LLM, SamplingParams
from kvpage.engine.async_llm import AsyncLLM
from kvpage.engine.outputs import RequestOutput, StreamDelta
from test_faults import assert_no_leak, bounded_generate
from test_faults import one_torch_thread  # noqa: F401 - an autouse fixture
from tiny_models import VOCAB, char_tokenizer, tiny_model

MAX_MODEL_LEN = 48
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
STREAM_TIMEOUT_S = 60.0

ODD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1e-45, 1e-30, 1e30, 1e308])
# Three in four draws come from valid inputs (so generation itself is fuzzed), one from anything.
VALID_PROMPT = st.one_of(st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=30),
                         st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30))
ANY_PROMPT = st.one_of(
    st.text(max_size=MAX_MODEL_LEN + 4),  # empty, non-ASCII, control characters, too long
    st.lists(st.integers(-3, VOCAB + 3), max_size=MAX_MODEL_LEN + 4),  # empty, out of vocabulary, too long
    st.sampled_from([None, 7, 2.5, [1.5, 2.0], ["a"], [None], b"\x05\x06", (5, 6, 7), [True, 9]]),
)


def mostly(valid, anything):
    """``valid`` three times in four, else ``anything`` (one_of would weigh them evenly)."""
    return st.integers(0, 3).flatmap(lambda k: valid if k else anything)


PROMPT = mostly(VALID_PROMPT, ANY_PROMPT)

VALID_FIELDS = dict(
    n=st.integers(1, 3),
    max_tokens=st.integers(1, 8),
    temperature=st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, 5e-324, 1e-30, 1e30]), st.floats(0.01, 3)),
    top_p=st.floats(1e-3, 1.0),
    top_k=st.integers(-1, VOCAB + 20),
    min_p=st.floats(0.0, 1.0),
    seed=st.one_of(st.none(), st.integers(-(2**70), 2**70)),
    repetition_penalty=st.one_of(st.floats(0.1, 3), st.sampled_from([5e-324, 1e-30, 1e30])),
    stop=st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    stop_token_ids=st.lists(st.integers(0, VOCAB + 5), max_size=3),
    ignore_eos=st.booleans(),
    min_tokens=st.integers(0, 1),
    logprobs=st.one_of(st.none(), st.integers(0, VOCAB + 20)),
    priority=st.integers(-3, 3),
)
ANY_FIELDS = dict(
    n=st.integers(-1, 3),
    max_tokens=st.one_of(st.integers(-1, 8), st.just(10_000)),
    temperature=st.one_of(ODD_FLOATS, st.floats(-1, 3)),
    top_p=st.one_of(st.floats(-0.5, 1.5), ODD_FLOATS),
    top_k=st.integers(-3, VOCAB + 20),
    min_p=st.one_of(st.floats(-0.5, 1.5), ODD_FLOATS),
    seed=st.one_of(st.none(), st.integers(-(2**70), 2**70), st.just("7")),
    repetition_penalty=st.one_of(st.floats(-1, 3), ODD_FLOATS),
    stop=st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), st.just(5)),
    stop_token_ids=st.one_of(st.lists(st.integers(-2, VOCAB + 5), max_size=3), st.just(3)),
    ignore_eos=st.booleans(),
    min_tokens=st.integers(-1, 6),
    logprobs=st.one_of(st.none(), st.integers(-1, VOCAB + 20)),
    priority=st.one_of(st.integers(-3, 3), st.just(1.5)),
)
PARAMS = mostly(st.fixed_dictionaries({}, optional=VALID_FIELDS), st.fixed_dictionaries({}, optional=ANY_FIELDS))


def make_params(fields: dict):
    """SamplingParams from fuzzed fields; a ValueError is an allowed outcome."""
    return SamplingParams(**fields)


def check_output(out: RequestOutput, params: SamplingParams) -> None:
    """A valid output: n samples, each ended by stop or length, within max_tokens and the vocabulary."""
    assert out.finished and len(out.outputs) == params.n
    for sample in out.outputs:
        assert sample.finish_reason in ("stop", "length"), (sample.finish_reason, sample.error)
        assert sample.error is None
        assert 1 <= len(sample.token_ids) <= params.max_tokens
        assert len(out.prompt_token_ids) + len(sample.token_ids) <= MAX_MODEL_LEN
        assert all(0 <= t < VOCAB for t in sample.token_ids)
        assert isinstance(sample.text, str)
        if params.logprobs is not None:
            assert len(sample.logprobs) == len(sample.token_ids)
            assert all(math.isfinite(v) or v == -math.inf for lp in sample.logprobs for v in lp.values())


@pytest.fixture(scope="module")
def llm():
    # 20 blocks of 4 = 80 token slots for up to 8 sequences: preemption is common.
    engine = LLM(tiny_model("llama"), tokenizer=char_tokenizer(), block_size=4, num_kv_blocks=20, max_num_seqs=8,
                 max_num_batched_tokens=16, max_model_len=MAX_MODEL_LEN)
    yield engine
    engine.restore()


# ---------------------------------------------------------------------- LLM.generate
def test_generate_gives_valid_output_or_value_error(llm):
    ends: Counter = Counter()

    @FUZZ
    @given(batch=st.lists(st.tuples(PROMPT, PARAMS), min_size=1, max_size=4))
    def run(batch):
        prompts = [p for p, _ in batch]
        try:
            params = [make_params(f) for _, f in batch]
            outs = bounded_generate(llm, prompts, params)
        except ValueError:
            ends["rejected"] += 1
            assert_no_leak(llm.engine)  # all or nothing: a bad prompt queues none of the batch
            return
        assert len(outs) == len(prompts)
        for out, p in zip(outs, params):
            check_output(out, p)
        ends["done"] += len(outs)
        assert_no_leak(llm.engine)

    run()
    print(f"fuzz LLM.generate: {dict(ends)}")
    assert ends["done"] >= 15 and ends["rejected"] >= 5  # both sides were exercised


# ---------------------------------------------------------------------- AsyncLLM
ABORT = st.one_of(st.none(), st.just("now"), st.integers(0, 6), st.tuples(st.just("external"), st.integers(0, 3)))


async def _consume(engine: AsyncLLM, prompt, fields: dict, abort) -> str:
    """One client: submit, read the stream, maybe abort. Returns how the request ended."""
    try:
        params = make_params(fields)
        stream = await engine.add_request(prompt, params)
    except ValueError:
        return "rejected"
    if abort == "now":
        stream.abort()
        return "aborted"
    if isinstance(abort, tuple):  # another coroutine aborts it while this one keeps reading
        async def later():
            for _ in range(abort[1]):
                await asyncio.sleep(0)
            await engine.abort(stream.request_id)

        asyncio.get_running_loop().create_task(later())
    items = 0
    async for item in stream:
        items += 1
        if isinstance(abort, int) and items > abort:
            break  # leaving the iteration aborts the request (a client disconnect)
        assert isinstance(item, (StreamDelta, RequestOutput))
        if isinstance(item, StreamDelta):
            assert item.error is None, item.error
        else:
            if any(s.finish_reason == "abort" for s in item.outputs):
                assert isinstance(abort, tuple)
                return "aborted"
            check_output(item, params)
            return "done"
    assert abort is not None, "the stream ended without a final output"
    return "aborted"


async def _wait_idle(engine: AsyncLLM, timeout_s: float = 30.0) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        stats = await asyncio.wait_for(engine.fresh_stats(), timeout_s)
        if stats["num_running"] == stats["num_waiting"] == 0:
            return stats
        assert loop.time() < deadline, f"aborted requests were never released: {stats}"
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def async_llm(llm):
    engine = AsyncLLM(llm.engine).start()
    yield engine
    engine.shutdown()
    assert_no_leak(llm.engine)


def test_async_engine_gives_valid_output_value_error_or_abort(async_llm):
    ends: Counter = Counter()

    @settings(FUZZ, max_examples=60)
    @given(clients=st.lists(st.tuples(PROMPT, PARAMS, ABORT), min_size=1, max_size=6))
    def run(clients):
        async def main():
            tasks = [_consume(async_llm, *client) for client in clients]
            got = await asyncio.wait_for(asyncio.gather(*tasks), STREAM_TIMEOUT_S)
            stats = await _wait_idle(async_llm)
            integrity = async_llm._call(async_llm.engine.check_integrity)
            await asyncio.wait_for(asyncio.wrap_future(integrity), 30)
            return got, stats

        got, stats = asyncio.run(main())
        ends.update(got)
        assert stats["num_free_blocks"] == stats["num_blocks"]
        assert async_llm.is_running

    run()
    print(f"fuzz AsyncLLM: {dict(ends)}")
    assert set(ends) == {"rejected", "aborted", "done"} and ends["done"] >= 20
