"""OutputProcessor on its own, over real Requests run through a Scheduler: deltas, stop
strings, failures before the first token, metrics read from the Requests, closing."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from kvpage import (
    CacheConfig,
    FinishReason,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from kvpage.core.request import sample_request_id
from kvpage.engine.interfaces import SampleResult
from kvpage.engine.output_processor import OutputProcessor, sequence_ids
from char_tokenizer import SPECIAL, CharTokenizer  # noqa: F401
from kvpage.engine.outputs import RequestMetrics, RequestOutput, StreamDelta

BS = 4


TOK = CharTokenizer()
ids = TOK.encode


def make_scheduler(num_blocks: int = 32) -> Scheduler:
    return Scheduler(CacheConfig(block_size=BS, num_blocks=num_blocks),
                     SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64))


class Harness:
    """A scheduler and an output processor, driven the way the engine drives them."""

    def __init__(self, tokenizer=TOK) -> None:
        self.sched = make_scheduler()
        self.op = OutputProcessor(tokenizer)

    def add(self, rid: str, prompt: str, params: SamplingParams, eos: Optional[int] = 2,
            arrival_time: Optional[float] = None, sink=None) -> Request:
        request = Request(sample_request_id(rid, 0, params.n), ids(prompt), params, eos,
                          arrival_time=arrival_time, group_id=rid)
        self.sched.add_request(request)
        self.op.add_request(rid, prompt, params, request, sink)
        return request

    def step(self, tokens: dict, forks: Optional[dict] = None, logprobs: Optional[dict] = None,
             skip: frozenset = frozenset(), finish_stopped: bool = True) -> list[StreamDelta]:
        """One step; ``tokens`` maps sequence id -> token, ``forks`` sequence id -> first
        tokens of the other samples, ``logprobs`` sequence id -> (entry, token logprob)."""
        out = self.sched.schedule()
        rows = out.sampled_requests
        lp = [(logprobs or {}).get(r.request_id, (None, math.nan)) for r in rows]
        result = SampleResult(np.array([tokens[r.request_id] for r in rows], dtype=np.int64),
                              [entry for entry, _ in lp], np.array([v for _, v in lp], dtype=np.float64))
        for row, r in enumerate(rows):
            if forks and r.request_id in forks:
                k = len(forks[r.request_id])
                result.forks[row] = SampleResult(np.array(forks[r.request_id], dtype=np.int64), [None] * k,
                                                 np.full(k, math.nan))
        skip_rows = {row for row, r in enumerate(rows) if r.request_id in skip}
        self.sched.update_from_output(out, result.token_ids,
                                      {row: f.token_ids for row, f in result.forks.items()} or None)
        deltas = self.op.process_step(out, result, skip_rows)
        if finish_stopped:
            self.sched.finish_requests(self.op.take_stopped(), FinishReason.STOP)
            self.op.close_finished()
        return deltas


def summary(deltas: list[StreamDelta]) -> list[tuple]:
    return [(d.request_id, d.index, d.text, d.token_ids, d.finish_reason) for d in deltas]


def test_deltas_carry_text_tokens_and_the_finish_reason():
    h = Harness()
    h.add("r", "AB", SamplingParams(max_tokens=3))
    assert summary(h.step({"r": 5})) == [("r", 0, "C", [5], None)]
    assert summary(h.step({"r": 6})) == [("r", 0, "D", [6], None)]
    assert summary(h.step({"r": 7})) == [("r", 0, "E", [7], "length")]
    assert h.op.states == {}
    done = h.op.take_finished()
    assert list(done) == ["r"]
    out = done["r"]
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.finished) == ("r", "AB", [3, 4], True)
    (sample,) = out.outputs
    assert (sample.index, sample.text, sample.token_ids, sample.finish_reason) == (0, "CDE", [5, 6, 7], "length")
    assert sample.logprobs is None and sample.cumulative_logprob is None and sample.error is None
    assert h.op.take_finished() == {}
    assert h.op.num_generation_tokens == 3


def test_eos_ends_with_stop_and_no_special_text():
    h = Harness()
    h.add("r", "AB", SamplingParams(max_tokens=5))
    h.step({"r": 5})
    assert summary(h.step({"r": 2})) == [("r", 0, "", [2], "stop")]
    out = h.op.take_finished()["r"].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == ("C", [5, 2], "stop")


def test_tokens_are_read_from_the_request_not_copied():
    h = Harness()
    request = h.add("r", "AB", SamplingParams(max_tokens=4))
    h.step({"r": 5})
    h.step({"r": 6})
    state = h.op.states["r"]
    assert state.samples[0].request is request
    assert state.output().outputs[0].token_ids == request.output_token_ids == [5, 6]
    assert sequence_ids(state) == ["r"]


def test_stop_string_is_reported_once_through_take_stopped():
    h = Harness()
    request = h.add("r", "AB", SamplingParams(max_tokens=10, stop=["DE"]))
    assert summary(h.step({"r": 5})) == [("r", 0, "", [5], None)]  # "C" held back: it could start "DE"
    assert summary(h.step({"r": 6})) == [("r", 0, "C", [6], None)]
    deltas = h.step({"r": 7}, finish_stopped=False)
    assert summary(deltas) == [("r", 0, "", [7], "stop")]
    assert not request.is_finished  # the engine finishes it in the scheduler, not the processor
    assert h.op.take_stopped() == ["r"]
    assert h.op.take_stopped() == []
    h.sched.finish_requests(["r"], FinishReason.STOP)
    h.op.close_finished()
    out = h.op.take_finished()["r"].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == ("C", [5, 6, 7], "stop")
    assert h.sched.pool.num_free_blocks == h.sched.pool.num_blocks
    h.sched.check_integrity()


def test_logprobs_accumulate_per_sample():
    h = Harness()
    h.add("r", "AB", SamplingParams(max_tokens=2, logprobs=1))
    d1 = h.step({"r": 5}, logprobs={"r": ({5: -0.5, 9: -1.5}, -0.5)})
    d2 = h.step({"r": 6}, logprobs={"r": ({6: -0.25}, -0.25)})
    assert d1[0].logprobs == [{5: -0.5, 9: -1.5}] and d2[0].logprobs == [{6: -0.25}]
    out = h.op.take_finished()["r"].outputs[0]
    assert out.logprobs == [{5: -0.5, 9: -1.5}, {6: -0.25}]
    assert out.cumulative_logprob == -0.75


def test_skipped_rows_get_no_delta():
    h = Harness()
    h.add("a", "AB", SamplingParams(max_tokens=3))
    h.add("b", "CD", SamplingParams(max_tokens=3))
    deltas = h.step({"a": 5, "b": 7}, skip=frozenset({"b"}))
    assert summary(deltas) == [("a", 0, "C", [5], None)]
    assert h.op.num_generation_tokens == 1


def test_without_a_tokenizer_text_stays_empty():
    h = Harness(tokenizer=None)
    h.add("r", "AB", SamplingParams(max_tokens=2, stop=["C"]))
    assert summary(h.step({"r": 5})) == [("r", 0, "", [5], None)]  # no detokenizer: no stop strings
    assert summary(h.step({"r": 6})) == [("r", 0, "", [6], "length")]
    assert h.op.take_finished()["r"].outputs[0].text == ""


def test_fail_before_the_first_token_of_n3_fails_every_sample():
    h = Harness()
    h.add("r", "ABCDE", SamplingParams(n=3, max_tokens=4))
    live = h.sched.finish_requests(["r#0"], FinishReason.ERROR, "boom")
    deltas = h.op.fail(live, "boom")
    assert [(d.request_id, d.index, d.text, d.token_ids, d.finish_reason, d.error) for d in deltas] == [
        ("r", k, "", [], "error", "boom") for k in range(3)]
    h.op.close_finished()
    out = h.op.take_finished()["r"]
    assert out.finished
    assert [(o.index, o.finish_reason, o.error, o.token_ids, o.text) for o in out.outputs] == [
        (k, "error", "boom", [], "") for k in range(3)]
    assert h.op.states == {}
    assert h.op.fail(live, "again") == []  # the state is gone: nothing more to report


def test_fail_of_one_forked_sample_keeps_the_request_open():
    h = Harness()
    h.add("r", "AB", SamplingParams(n=2, max_tokens=2))
    deltas = h.step({"r#0": 5}, forks={"r#0": [9]})
    assert summary(deltas) == [("r", 0, "C", [5], None), ("r", 1, "G", [9], None)]
    live = h.sched.finish_requests(["r#1"], FinishReason.ERROR, "lost")
    assert [(d.index, d.finish_reason, d.error) for d in h.op.fail(live, "lost")] == [(1, "error", "lost")]
    h.op.close_finished()
    assert "r" in h.op.states and h.op.take_finished() == {}
    h.step({"r#0": 6})
    out = h.op.take_finished()["r"]
    assert [(o.index, o.text, o.token_ids, o.finish_reason, o.error) for o in out.outputs] == [
        (0, "CD", [5, 6], "length", None), (1, "G", [9], "error", "lost")]


def test_forked_samples_get_their_own_detokenizer_and_deltas():
    h = Harness()
    h.add("r", "AB", SamplingParams(n=3, max_tokens=2, stop=["X"]))
    deltas = h.step({"r#0": 5}, forks={"r#0": [6, 7]})
    assert summary(deltas) == [("r", 0, "C", [5], None), ("r", 1, "D", [6], None), ("r", 2, "E", [7], None)]
    assert [s.request.request_id for s in h.op.states["r"].samples] == ["r#0", "r#1", "r#2"]
    deltas = h.step({"r#0": 8, "r#1": 9, "r#2": 10})
    assert sorted(summary(deltas), key=lambda d: d[1]) == [
        ("r", 0, "F", [8], "length"), ("r", 1, "G", [9], "length"), ("r", 2, "H", [10], "length")]
    out = h.op.take_finished()["r"]
    assert [(o.index, o.text) for o in out.outputs] == [(0, "CF"), (1, "DG"), (2, "EH")]


def test_close_finished_waits_for_every_sample():
    h = Harness()
    h.add("r", "AB", SamplingParams(n=2, max_tokens=5, stop_token_ids=[20]))
    h.step({"r#0": 20}, forks={"r#0": [5]})  # sample 0 stops at once, sample 1 runs on
    state = h.op.states["r"]
    assert state.samples[0].request.is_finished and not state.samples[1].request.is_finished
    assert not state.finished and h.op.take_finished() == {}
    h.step({"r#1": 6})
    assert "r" in h.op.states
    deltas = h.step({"r#1": 20})
    assert summary(deltas) == [("r", 1, "R", [20], "stop")]  # a stop id that is no special token keeps its text
    assert h.op.states == {}
    out = h.op.take_finished()["r"]
    assert [(o.token_ids, o.finish_reason) for o in out.outputs] == [([20], "stop"), ([5, 6, 20], "stop")]


def test_close_finished_leaves_unforked_requests_open():
    h = Harness()
    h.add("r", "AB", SamplingParams(n=2, max_tokens=3))
    state = h.op.states["r"]
    h.op._closing.append(state)  # even if asked to look at it
    h.op.close_finished()
    assert h.op.states == {"r": state} and not state.finished


def test_metrics_are_read_from_the_requests():
    h = Harness()
    request = h.add("r", "AB", SamplingParams(max_tokens=2), arrival_time=100.0)
    h.step({"r": 5})
    first = request.first_token_time
    assert first is not None and request.last_token_time == first
    h.step({"r": 6})
    out = h.op.take_finished()["r"]
    m = out.metrics
    assert m.arrival_time == 100.0
    assert (m.first_token_time, m.last_token_time) == (first, request.last_token_time)
    assert m.last_token_time >= m.first_token_time
    assert m.finished_time >= m.last_token_time
    assert m.num_cached_tokens == 0 and m.num_preemptions == 0
    assert m.time_to_first_token == first - 100.0


def test_metrics_of_several_samples_take_min_first_and_max_last():
    h = Harness()
    h.add("r", "AB", SamplingParams(n=2, max_tokens=3), arrival_time=10.0)
    h.step({"r#0": 5}, forks={"r#0": [6]})
    s0, s1 = (s.request for s in h.op.states["r"].samples)
    s0.first_token_time, s0.last_token_time, s0.num_preemptions = 11.0, 14.0, 1
    s1.first_token_time, s1.last_token_time, s1.num_preemptions = 12.0, 13.0, 2
    s0.num_cached_tokens = 4
    assert h.op.states["r"].metrics() == RequestMetrics(10.0, 11.0, 14.0, None, 4, 2)


def test_num_cached_tokens_comes_from_the_prefix_cache_hit():
    h = Harness()
    h.add("a", "ABCDEFGHI", SamplingParams(max_tokens=1))
    h.step({"a": 20})
    assert h.op.take_finished()["a"].num_cached_tokens == 0
    b = h.add("b", "ABCDEFGHJ", SamplingParams(max_tokens=1))
    h.step({"b": 21})
    out = h.op.take_finished()["b"]
    assert b.num_cached_tokens == 8  # two full blocks of 4 shared with "a"
    assert out.num_cached_tokens == out.metrics.num_cached_tokens == 8


def test_sink_receives_deltas_then_the_output_and_abort_closes():
    h = Harness()
    got = []
    h.add("s", "AB", SamplingParams(max_tokens=2), sink=got.append)
    deltas = h.step({"s": 5})
    assert got == deltas
    h.step({"s": 6})
    assert [type(x).__name__ for x in got] == ["StreamDelta", "StreamDelta", "RequestOutput"]
    assert got[-1].outputs[0].text == "CD"
    assert h.op.take_finished() == {}

    got.clear()
    h.add("t", "AB", SamplingParams(max_tokens=5), sink=got.append)
    h.step({"t": 5})
    h.sched.finish_requests(["t"], FinishReason.ABORT)
    out = h.op.abort("t")
    assert isinstance(out, RequestOutput) and got[-1] is out
    assert (out.outputs[0].finish_reason, out.outputs[0].token_ids, out.finished) == ("abort", [5], True)
    assert h.op.abort("t") is None and h.op.states == {} and h.op.take_finished() == {}


def test_abort_without_delivery_sends_nothing():
    h = Harness()
    got = []
    h.add("t", "AB", SamplingParams(max_tokens=5), sink=got.append)
    h.sched.finish_requests(["t"], FinishReason.ABORT)
    out = h.op.abort("t", deliver=False)
    assert got == [] and out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
