"""LLMEngine with a fake model runner and the real torch Sampler: intake validation,
exact greedy runs, EOS and stop strings, n > 1 forks, fault isolation, abort, sinks,
step observers and stats."""
from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch

from kvpage import CacheConfig, SamplingParams, Scheduler, SchedulerConfig
from kvpage.core.sched.metadata import StepMetadata
from kvpage.engine.llm_engine import LLMEngine
from kvpage.engine.interfaces import ModelRunner
from kvpage.engine.interfaces import Sampler as SamplerProtocol
from char_tokenizer import SPECIAL, CharTokenizer  # noqa: F401
from kvpage.engine.outputs import RequestOutput, StreamDelta
from kvpage.engine.sampler import Sampler

V = 40
BS = 4
NUM_BLOCKS = 32


def ids(text: str) -> list[int]:
    return CharTokenizer().encode(text)


def text(token_ids) -> str:
    return CharTokenizer().decode(token_ids, skip_special_tokens=True)


class NextTokenRunner:
    """Deterministic logits that favour (last input id + 1) % V for every sampled row.

    ``fail(metadata)`` may raise; ``nan_for`` names request ids whose row is NaN;
    ``bad_shape`` returns one row too many.
    """

    def __init__(self, peak: float = 50.0, fail: Optional[Callable[[StepMetadata], None]] = None) -> None:
        self.peak = peak
        self.fail = fail
        self.nan_for: set[str] = set()
        self.bad_shape = False
        self.calls: list[list[str]] = []

    def execute(self, metadata: StepMetadata) -> torch.Tensor:
        self.calls.append(list(metadata.request_ids))
        if self.fail is not None:
            self.fail(metadata)
        last = torch.as_tensor(metadata.input_ids[metadata.logits_indices], dtype=torch.long)
        rows = last.shape[0]
        logits = torch.zeros(rows, V, dtype=torch.float32)
        logits[torch.arange(rows), (last + 1) % V] = self.peak
        for row, seq in enumerate(metadata.sample_seq_indices.tolist()):
            if metadata.request_ids[seq] in self.nan_for:
                logits[row] = float("nan")
        if self.bad_shape:
            return torch.zeros(rows + 1, V)
        return logits


class FlatRunner(NextTokenRunner):
    """Uniform logits: every token equally likely (for seeded sampling)."""

    def execute(self, metadata: StepMetadata) -> torch.Tensor:
        return torch.zeros(len(metadata.logits_indices), V)


def make_engine(runner=None, sampler=None, eos=(2,), num_blocks=NUM_BLOCKS, max_num_seqs=8,
                tokenizer="chars") -> LLMEngine:
    scheduler = Scheduler(CacheConfig(block_size=BS, num_blocks=num_blocks),
                          SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64))
    return LLMEngine(runner or NextTokenRunner(), sampler or Sampler(), CharTokenizer() if tokenizer == "chars"
                     else tokenizer, scheduler, V, eos)


def greedy(max_tokens: int = 5, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def run(engine: LLMEngine, max_steps: int = 200) -> list[StreamDelta]:
    deltas = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return deltas
        deltas += engine.step()
    raise AssertionError("requests did not finish")


def assert_no_leak(engine: LLMEngine) -> None:
    s = engine.scheduler
    assert s.pool.num_free_blocks == s.pool.num_blocks
    assert s.requests == {} and s.num_running == 0 and s.num_waiting == 0
    assert not engine.has_unfinished_requests()
    s.check_integrity()


def test_fakes_satisfy_the_protocols():
    assert isinstance(NextTokenRunner(), ModelRunner)
    assert isinstance(Sampler(), SamplerProtocol)


# ---------------------------------------------------------------------- intake
@pytest.mark.parametrize("prompt, message", [
    ("", "the prompt is empty"),
    ([], "the prompt is empty"),
    ([3, 40], r"prompt token ids \[40\] are outside the vocabulary \[0, 40\)"),
    ([-1, 5], r"prompt token ids \[-1\] are outside the vocabulary \[0, 40\)"),
    ("A~", r"prompt token ids \[64\] are outside the vocabulary \[0, 40\)"),  # "~" encodes to 64
    ([3, 4.0], "a prompt must be a string or a sequence of integer token ids"),
])
def test_add_request_rejects_bad_prompts(prompt, message):
    engine = make_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, greedy())
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.requests == {}
    assert engine.stats()["prompt_tokens"] == 0


def test_add_request_rejects_non_sampling_params_and_duplicate_ids():
    engine = make_engine()
    with pytest.raises(ValueError, match="sampling params must be a SamplingParams, got dict"):
        engine.add_request("AB", {"max_tokens": 3})
    assert engine.add_request("AB", greedy(), request_id="dup") == "dup"
    with pytest.raises(ValueError, match="request id 'dup' is already in use"):
        engine.add_request("CD", greedy(), request_id="dup")
    assert list(engine.outputs.states) == ["dup"]
    assert engine.stats()["prompt_tokens"] == 2


def test_a_request_the_scheduler_rejects_leaves_no_engine_state():
    engine = make_engine()
    with pytest.raises(ValueError, match="leaves no room to generate within max_model_len=64"):
        engine.add_request("A" * 64, greedy(), request_id="long")
    assert not engine.has_request("long") and engine.stats()["prompt_tokens"] == 0
    engine.add_request("A" * 63, greedy(), request_id="long")  # the id is still free
    assert engine.has_request("long")


def test_request_ids_default_to_a_counter_and_are_strings():
    engine = make_engine()
    assert engine.add_request("A", greedy()) == "0"
    assert engine.add_request("A", greedy()) == "1"
    assert engine.add_request("A", greedy(), request_id=7) == "7"
    assert engine.has_request("7")


# ---------------------------------------------------------------------- generation
def test_greedy_run_to_length_gives_exact_tokens_and_text():
    engine = make_engine()
    engine.add_request("ABC", greedy(max_tokens=5), request_id="r")
    deltas = run(engine)
    assert [(d.request_id, d.index, d.text, d.token_ids, d.finish_reason) for d in deltas] == [
        ("r", 0, "D", [6], None), ("r", 0, "E", [7], None), ("r", 0, "F", [8], None),
        ("r", 0, "G", [9], None), ("r", 0, "H", [10], "length")]
    out = engine.take_finished()["r"]
    assert (out.prompt, out.prompt_token_ids, out.finished) == ("ABC", [3, 4, 5], True)
    (sample,) = out.outputs
    assert (sample.index, sample.text, sample.token_ids, sample.finish_reason) == (0, "DEFGH", [6, 7, 8, 9, 10],
                                                                                    "length")
    assert engine.take_finished() == {}
    assert engine.runner.calls == [["r"]] * 5  # one prefill step, then four decodes
    assert_no_leak(engine)


def test_token_prompts_have_no_prompt_text():
    engine = make_engine()
    engine.add_request([10, 11], greedy(max_tokens=2), request_id="t")
    run(engine)
    out = engine.take_finished()["t"]
    assert out.prompt is None and out.prompt_token_ids == [10, 11]
    assert out.outputs[0].token_ids == [12, 13] and out.outputs[0].text == "JK"


def test_peaked_logits_make_default_temperature_deterministic_too():
    engine = make_engine()
    engine.add_request("A", SamplingParams(max_tokens=3, seed=1), request_id="s")
    run(engine)
    assert engine.take_finished()["s"].outputs[0].token_ids == [4, 5, 6]


def test_eos_stops_and_its_special_text_is_dropped():
    engine = make_engine(eos=(2,))
    engine.add_request([37], greedy(max_tokens=10), request_id="e")
    run(engine)
    sample = engine.take_finished()["e"].outputs[0]
    assert sample.token_ids == [38, 39, 0, 1, 2]  # wraps around the vocabulary into the specials
    assert sample.finish_reason == "stop"
    assert sample.text == "de"
    assert_no_leak(engine)


def test_ignore_eos_runs_to_length():
    engine = make_engine(eos=(2,))
    engine.add_request([37], greedy(max_tokens=7, ignore_eos=True), request_id="e")
    run(engine)
    sample = engine.take_finished()["e"].outputs[0]
    assert sample.token_ids == [38, 39, 0, 1, 2, 3, 4] and sample.finish_reason == "length"
    assert sample.text == "deAB"


def test_second_eos_id_acts_as_a_stop_id():
    engine = make_engine(eos=(2, 6))
    params = greedy(max_tokens=10)
    engine.add_request("A", params, request_id="m")
    seq = engine.scheduler.requests["m"]
    assert seq.eos_token_id == 2 and tuple(seq.sampling_params.stop_token_ids) == (6,)
    assert tuple(params.stop_token_ids) == ()  # the caller's params are not changed
    run(engine)
    sample = engine.take_finished()["m"].outputs[0]
    assert (sample.token_ids, sample.finish_reason, sample.text) == ([4, 5, 6], "stop", "BCD")


def test_multi_eos_with_ignore_eos_adds_no_stop_ids():
    engine = make_engine(eos=(2, 6))
    engine.add_request("A", greedy(max_tokens=4, ignore_eos=True), request_id="m")
    assert tuple(engine.scheduler.requests["m"].sampling_params.stop_token_ids) == ()
    run(engine)
    assert engine.take_finished()["m"].outputs[0].token_ids == [4, 5, 6, 7]


def test_stop_token_ids_end_the_request():
    engine = make_engine()
    engine.add_request("A", greedy(max_tokens=10, stop_token_ids=[7]), request_id="s")
    run(engine)
    sample = engine.take_finished()["s"].outputs[0]
    assert (sample.token_ids, sample.finish_reason) == ([4, 5, 6, 7], "stop")


def test_min_tokens_masks_eos_until_reached():
    engine = make_engine(eos=(5,))
    engine.add_request("A", greedy(max_tokens=6, min_tokens=3), request_id="s")
    engine.add_request("A", greedy(max_tokens=6, min_tokens=1), request_id="t")
    run(engine)
    finished = engine.take_finished()
    masked, allowed = finished["s"].outputs[0], finished["t"].outputs[0]
    # The runner wants EOS (5) second. Under min_tokens=3 it cannot be drawn (its logit is
    # -inf; the flat rest gives 0), so the run goes on to its length.
    assert masked.token_ids == [4, 0, 1, 2, 3, 4] and masked.finish_reason == "length"
    assert allowed.token_ids == [4, 5] and allowed.finish_reason == "stop"


def test_stop_string_ends_the_request_in_the_same_step_and_frees_blocks():
    engine = make_engine()
    engine.add_request("AB", greedy(max_tokens=10, stop=["EF"]), request_id="s")
    steps = []
    while engine.has_unfinished_requests():
        steps.append([(d.text, d.token_ids, d.finish_reason) for d in engine.step()])
    # "EF" needs one character held back; the step that completes it ends the request.
    assert steps == [[("", [5], None)], [("C", [6], None)], [("D", [7], None)], [("", [8], "stop")]]
    sample = engine.take_finished()["s"].outputs[0]
    assert (sample.text, sample.token_ids, sample.finish_reason) == ("CD", [5, 6, 7, 8], "stop")
    assert engine.runner.calls == [["s"]] * 4  # nothing ran after the stop
    assert_no_leak(engine)


def test_stop_strings_of_several_requests_in_one_step():
    engine = make_engine()
    engine.add_request("A", greedy(max_tokens=10, stop=["C"]), request_id="x")
    engine.add_request("B", greedy(max_tokens=10, stop=["D"]), request_id="y")
    engine.add_request("C", greedy(max_tokens=3), request_id="z")
    run(engine)
    done = engine.take_finished()
    assert {k: (v.outputs[0].text, v.outputs[0].token_ids, v.outputs[0].finish_reason) for k, v in done.items()} == {
        "x": ("B", [4, 5], "stop"), "y": ("C", [5, 6], "stop"), "z": ("DEF", [6, 7, 8], "length")}
    assert_no_leak(engine)


def test_n_greater_than_one_forks_at_the_first_token_sharing_prompt_blocks():
    engine = make_engine()
    engine.add_request("ABCDEFGH", greedy(max_tokens=3, n=3), request_id="p")
    assert list(engine.scheduler.requests) == ["p#0"]
    first = engine.step()
    assert [(d.index, d.token_ids, d.text) for d in first] == [(0, [11], "I"), (1, [11], "I"), (2, [11], "I")]
    seqs = engine.scheduler.requests
    assert sorted(seqs) == ["p#0", "p#1", "p#2"]
    blocks = seqs["p#0"].block_ids
    assert len(blocks) == 2  # 8 prompt tokens, 4 per block
    assert seqs["p#1"].block_ids == blocks and seqs["p#2"].block_ids == blocks
    assert [engine.scheduler.pool.ref_count(b) for b in blocks] == [3, 3]
    assert engine.scheduler.pool.num_free_blocks == NUM_BLOCKS - 2
    engine.check_integrity()
    run(engine)
    out = engine.take_finished()["p"]
    assert [(o.index, o.token_ids, o.text, o.finish_reason) for o in out.outputs] == [
        (k, [11, 12, 13], "IJK", "length") for k in range(3)]
    assert engine.stats()["generation_tokens"] == 9
    assert_no_leak(engine)


def test_seeded_parallel_samples_are_reproducible():
    def sample_once():
        engine = make_engine(runner=FlatRunner())
        engine.add_request("AB", SamplingParams(n=4, max_tokens=6, seed=123, ignore_eos=True), request_id="q")
        run(engine)
        return [o.token_ids for o in engine.take_finished()["q"].outputs]

    first = sample_once()
    assert first == sample_once()
    assert len(first) == 4 and all(len(t) == 6 for t in first)
    assert len({tuple(t) for t in first}) == 4  # each sample has its own seed


# ---------------------------------------------------------------------- faults
def test_runner_exception_fails_only_that_steps_requests():
    def fail_first(metadata):
        if "a" in metadata.request_ids:
            raise RuntimeError("boom")

    engine = make_engine(runner=NextTokenRunner(fail=fail_first), max_num_seqs=1)
    engine.add_request("AB", greedy(max_tokens=3), request_id="a")
    engine.add_request("CD", greedy(max_tokens=3), request_id="waits")  # no seat: not in that step
    deltas = engine.step()
    assert [(d.request_id, d.index, d.token_ids, d.finish_reason, d.error) for d in deltas] == [
        ("a", 0, [], "error", "model step failed: RuntimeError: boom")]
    failed = engine.take_finished()["a"]
    assert failed.outputs[0].finish_reason == "error"
    assert failed.outputs[0].error == "model step failed: RuntimeError: boom"
    assert engine.has_request("waits") and not engine.has_request("a")
    engine.add_request("EF", greedy(max_tokens=2), request_id="later")
    run(engine)
    done = engine.take_finished()
    assert {k: (v.outputs[0].token_ids, v.outputs[0].finish_reason) for k, v in done.items()} == {
        "waits": ([7, 8, 9], "length"), "later": ([9, 10], "length")}
    assert engine.stats()["num_step_errors"] == 1
    assert_no_leak(engine)


def test_runner_exception_mid_decode_fails_all_running_requests_of_the_step():
    runner = NextTokenRunner()
    engine = make_engine(runner=runner)
    engine.add_request("AB", greedy(max_tokens=5), request_id="x")
    engine.add_request("CD", greedy(max_tokens=5), request_id="y")
    engine.step()
    def boom(metadata):
        raise ValueError("device lost")
    runner.fail = boom
    deltas = engine.step()
    assert sorted((d.request_id, d.finish_reason, d.error) for d in deltas) == [
        ("x", "error", "model step failed: ValueError: device lost"),
        ("y", "error", "model step failed: ValueError: device lost")]
    done = engine.take_finished()
    assert {k: v.outputs[0].token_ids for k, v in done.items()} == {"x": [5], "y": [7]}
    assert_no_leak(engine)


def test_wrong_logits_shape_fails_the_step():
    runner = NextTokenRunner()
    runner.bad_shape = True
    engine = make_engine(runner=runner)
    engine.add_request("AB", greedy(max_tokens=3), request_id="r")
    deltas = engine.step()
    message = "model step failed: RuntimeError: the runner returned logits of shape (2, 40); expected (1, vocab)"
    assert [(d.finish_reason, d.error) for d in deltas] == [("error", message)]
    assert engine.take_finished()["r"].outputs[0].error == message
    assert engine.num_step_errors == 1
    assert_no_leak(engine)


def test_nan_row_fails_only_its_request():
    runner = NextTokenRunner()
    runner.nan_for = {"bad"}
    engine = make_engine(runner=runner)
    engine.add_request("AB", greedy(max_tokens=3), request_id="good")
    engine.add_request("CD", greedy(max_tokens=3), request_id="bad")
    deltas = engine.step()
    assert sorted((d.request_id, d.token_ids, d.finish_reason, d.error) for d in deltas) == [
        ("bad", [], "error", "the model produced non-finite logits"), ("good", [5], None, None)]
    assert engine.has_request("good") and not engine.has_request("bad")
    run(engine)
    done = engine.take_finished()
    assert (done["bad"].outputs[0].finish_reason, done["bad"].outputs[0].token_ids) == ("error", [])
    assert (done["good"].outputs[0].token_ids, done["good"].outputs[0].finish_reason) == ([5, 6, 7], "length")
    assert engine.num_step_errors == 0  # the step ran; one row was bad
    assert_no_leak(engine)


def test_nan_row_of_a_parallel_request_fails_all_its_samples():
    runner = NextTokenRunner()
    runner.nan_for = {"n#0"}
    engine = make_engine(runner=runner)
    engine.add_request("AB", greedy(max_tokens=3, n=3), request_id="n")
    deltas = engine.step()
    assert [(d.index, d.finish_reason) for d in deltas] == [(0, "error"), (1, "error"), (2, "error")]
    out = engine.take_finished()["n"]
    assert out.finished and [o.error for o in out.outputs] == ["the model produced non-finite logits"] * 3
    assert_no_leak(engine)


class PickySampler:
    """The real sampler, except that it cannot draw for request "bad"."""

    def __init__(self) -> None:
        self.inner = Sampler()
        self.batch_sizes: list[int] = []

    def sample(self, logits, requests):
        self.batch_sizes.append(len(requests))
        if any(r.group_id == "bad" for r in requests):
            raise ValueError("cannot draw")
        return self.inner.sample(logits, requests)


def test_sampler_failure_is_retried_row_by_row_and_fails_only_that_request():
    sampler = PickySampler()
    engine = make_engine(sampler=sampler)
    engine.add_request("AB", greedy(max_tokens=3), request_id="ok1")
    engine.add_request("CD", greedy(max_tokens=3), request_id="bad")
    engine.add_request("EF", greedy(max_tokens=3), request_id="ok2")
    deltas = engine.step()
    assert sampler.batch_sizes == [3, 1, 1, 1]  # the batch, then each row alone
    assert sorted((d.request_id, d.token_ids, d.finish_reason, d.error) for d in deltas) == [
        ("bad", [], "error", "sampling failed: ValueError: cannot draw"),
        ("ok1", [5], None, None), ("ok2", [9], None, None)]
    run(engine)
    done = engine.take_finished()
    assert {k: (v.outputs[0].token_ids, v.outputs[0].finish_reason) for k, v in done.items()} == {
        "bad": ([], "error"), "ok1": ([5, 6, 7], "length"), "ok2": ([9, 10, 11], "length")}
    assert sampler.batch_sizes[4:] == [2, 2]  # later steps sample in one batch again
    assert_no_leak(engine)


# ---------------------------------------------------------------------- abort
def test_abort_returns_the_output_so_far_and_frees_blocks():
    engine = make_engine()
    engine.add_request("ABCDE", greedy(max_tokens=10), request_id="r")
    engine.step()
    engine.step()
    assert engine.scheduler.pool.num_free_blocks < NUM_BLOCKS
    out = engine.abort_with_output("r")
    assert isinstance(out, RequestOutput) and out.finished
    assert (out.outputs[0].token_ids, out.outputs[0].text, out.outputs[0].finish_reason) == ([8, 9], "FG", "abort")
    assert engine.take_finished() == {}  # an abort's output goes to its caller only
    assert engine.abort("r") is False and engine.abort_with_output("r") is None
    assert_no_leak(engine)


def test_abort_of_a_waiting_request():
    engine = make_engine(max_num_seqs=1)
    engine.add_request("AB", greedy(max_tokens=4), request_id="runs")
    engine.add_request("CD", greedy(max_tokens=4), request_id="queued")
    engine.step()
    assert engine.scheduler.num_waiting == 1
    assert engine.abort("queued") is True
    assert engine.scheduler.num_waiting == 0 and not engine.has_request("queued")
    run(engine)
    assert list(engine.take_finished()) == ["runs"]
    assert_no_leak(engine)


def test_abort_delivers_to_a_sink():
    engine = make_engine()
    got = []
    engine.add_request("AB", greedy(max_tokens=4), request_id="s", sink=got.append)
    engine.step()
    out = engine.abort_with_output("s")
    assert [type(x) for x in got] == [StreamDelta, RequestOutput] and got[-1] is out
    assert out.outputs[0].finish_reason == "abort"
    got.clear()
    engine.add_request("AB", greedy(max_tokens=4), request_id="quiet", sink=got.append)
    out = engine.abort_with_output("quiet", deliver=False)
    assert got == [] and out.outputs[0].finish_reason == "abort"


def test_abort_all_returns_sinks_and_leaves_nothing_live():
    engine = make_engine(max_num_seqs=2)
    got_a, got_b = [], []
    engine.add_request("AB", greedy(max_tokens=5), request_id="a", sink=got_a.append)
    engine.add_request("CD", greedy(max_tokens=5), request_id="b")
    engine.add_request("EF", greedy(max_tokens=5), request_id="c", sink=got_b.append)  # still waiting
    engine.step()
    sinks = engine.abort_all()
    assert sinks == [got_a.append, None, got_b.append]
    assert len(got_a) == 1 and isinstance(got_a[0], StreamDelta) and got_b == []  # nothing delivered
    assert engine.take_finished() == {}
    assert engine.outputs.states == {}
    assert engine.step() == []
    assert_no_leak(engine)


# ---------------------------------------------------------------------- sinks, observers, stats
def test_sinks_receive_each_delta_then_the_final_output():
    engine = make_engine()
    got = []
    engine.add_request("AB", greedy(max_tokens=3), request_id="s", sink=got.append)
    engine.add_request("CD", greedy(max_tokens=2), request_id="plain")
    deltas = run(engine)
    mine = [d for d in deltas if d.request_id == "s"]
    assert got[:-1] == mine and all(a is b for a, b in zip(got, mine))
    assert [(d.text, d.token_ids, d.finish_reason) for d in mine] == [
        ("C", [5], None), ("D", [6], None), ("E", [7], "length")]
    final = got[-1]
    assert isinstance(final, RequestOutput) and final.finished
    assert (final.request_id, final.outputs[0].text, final.outputs[0].token_ids) == ("s", "CDE", [5, 6, 7])
    assert list(engine.take_finished()) == ["plain"]  # the sink request is never kept there


def test_sink_of_a_parallel_request_gets_every_samples_deltas():
    engine = make_engine()
    got = []
    engine.add_request("AB", greedy(max_tokens=2, n=2), request_id="p", sink=got.append)
    run(engine)
    assert [(x.index, x.token_ids, x.finish_reason) for x in got[:-1]] == [
        (0, [5], None), (1, [5], None), (0, [6], "length"), (1, [6], "length")]
    assert [o.text for o in got[-1].outputs] == ["CD", "CD"]


def test_step_observers_see_every_non_empty_step():
    engine = make_engine()
    seen = []
    engine.add_step_observer(seen.append)
    assert engine.step() == [] and seen == []  # nothing to run: not called
    engine.add_request("AB", greedy(max_tokens=3), request_id="a")
    engine.add_request("CDE", greedy(max_tokens=1), request_id="b")
    run(engine)
    assert engine.step() == []
    assert len(seen) == 3
    assert [[r.request_id for r in out.requests] for out in seen] == [["a", "b"], ["a"], ["a"]]
    assert [out.num_new_tokens for out in seen] == [[2, 3], [1], [1]]
    assert engine.stats()["num_steps"] == 3  # the built-in StepStats observer counted the same steps


def test_step_observer_runs_before_the_model():
    runner = NextTokenRunner()
    engine = make_engine(runner=runner)
    order = []
    engine.add_step_observer(lambda out: order.append(("observer", len(runner.calls))))
    engine.add_request("AB", greedy(max_tokens=2))
    run(engine)
    assert order == [("observer", 0), ("observer", 1)]


def test_stats_count_prompt_and_generation_tokens():
    engine = make_engine()
    engine.add_request("ABC", greedy(max_tokens=4))
    engine.add_request([5, 6, 7, 8, 9], greedy(max_tokens=2))
    engine.add_request("AB", greedy(max_tokens=3, n=2))
    with pytest.raises(ValueError):
        engine.add_request("", greedy())
    run(engine)
    stats = engine.stats()
    assert stats["prompt_tokens"] == 3 + 5 + 2
    assert stats["generation_tokens"] == 4 + 2 + 2 * 3
    assert stats["num_step_errors"] == 0
    assert stats["num_steps"] == 4
    assert stats["num_free_blocks"] == stats["num_blocks"] == NUM_BLOCKS
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["peak_num_running"] == 4  # three requests, one of them with two samples
    assert 0.0 < stats["peak_kv_cache_usage"] <= 1.0


def test_engine_without_a_tokenizer_takes_token_prompts_only():
    engine = make_engine(tokenizer=None)
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer; pass token ids instead"):
        engine.add_request("AB", greedy())
    engine.add_request([3, 4], greedy(max_tokens=2), request_id="t")
    run(engine)
    out = engine.take_finished()["t"].outputs[0]
    assert out.token_ids == [5, 6] and out.text == ""


# ---------------------------------------------------------------------- regressions of bugs these tests found

def test_abort_before_the_first_token_of_n3_aborts_every_sample():
    engine = make_engine()
    engine.add_request("AB", greedy(max_tokens=4, n=3), request_id="p")
    out = engine.abort_with_output("p")
    assert [(o.index, o.finish_reason, o.token_ids) for o in out.outputs] == [(k, "abort", []) for k in range(3)]
    assert out.finished


def test_stop_string_completed_by_the_last_allowed_token_reports_stop():
    engine = make_engine()
    engine.add_request("AB", greedy(max_tokens=3, stop=["DE"]), request_id="s")
    run(engine)
    sample = engine.take_finished()["s"].outputs[0]
    assert (sample.text, sample.token_ids) == ("C", [5, 6, 7])  # this part holds today
    assert sample.finish_reason == "stop"


def test_a_user_id_shaped_like_a_sample_id_does_not_break_forking():
    engine = make_engine()
    with pytest.raises(ValueError, match="reserved for naming parallel samples"):
        engine.add_request("AB", greedy(max_tokens=3), request_id="x#1")
    engine.add_request("CD", greedy(max_tokens=3, n=2), request_id="x")
    run(engine, max_steps=20)
    done = engine.take_finished()
    assert [o.token_ids for o in done["x"].outputs] == [[7, 8, 9], [7, 8, 9]]


def test_automatic_ids_skip_ids_the_caller_chose():
    engine = make_engine()
    engine.add_request("AB", greedy(max_tokens=2), request_id="0")
    assert engine.add_request("CD", greedy(max_tokens=2)) == "1"
