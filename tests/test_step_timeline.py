"""The step timeline (kvpage.engine.step_timeline): records that add up, and their summary."""
from __future__ import annotations

import pytest

from kvpage import LLM, SamplingParams
from kvpage.engine.step_timeline import StepRecord, load, summarize
from tiny_models import tiny_model


def _record(start: float, wall: float, cpu: float, seqs: int, tokens: int) -> StepRecord:
    return StepRecord(start=start, schedule_s=0.1 * wall, forward_s=0.8 * wall, post_s=0.1 * wall,
                      thread_cpu_s=cpu, process_cpu_s=2 * cpu, num_seqs=seqs, num_tokens=tokens)


def test_summary_splits_decode_and_mixed_steps_and_measures_gaps_and_off_cpu_time():
    records = [_record(0.0, 0.010, 0.006, 4, 4), _record(0.012, 0.010, 0.010, 4, 4),
               _record(0.030, 0.020, 0.020, 4, 40), _record(0.051, 0.010, 0.008, 2, 2)]
    every = summarize(records)
    assert every["decode"]["steps"] == 3 and every["mixed"]["steps"] == 1
    assert every["decode"]["wall_ms"] == pytest.approx(10.0)
    assert every["decode"]["engine_off_cpu_ms"] == pytest.approx((4 + 0 + 2) / 3)
    assert every["decode"]["other_threads_cpu_ms"] == pytest.approx((6 + 10 + 8) / 3)
    # gaps from the previous step's end: 2 ms before the second, 1 ms before the last
    assert every["decode"]["gap_ms"] == pytest.approx(1.5)
    assert every["mixed"]["gap_ms"] == pytest.approx(8.0)
    at_four = summarize(records, num_seqs=4)
    assert at_four["decode"]["steps"] == 2 and at_four["decode"]["mean_seqs"] == 4


def test_an_engine_records_its_steps_to_the_file_the_environment_names(tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("KVPAGE_STEP_TIMELINE", str(path))
    llm = LLM(tiny_model("llama"), block_size=4, num_kv_blocks=32, max_model_len=32)
    try:
        llm.generate([[3, 4, 5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                     use_tqdm=False)
    finally:
        llm.close()
        llm.restore()
    records = load(str(path))
    # one step prefills both prompts (and samples their first tokens), three decode both
    assert [(r.num_seqs, r.num_tokens) for r in records] == [(2, 7), (2, 2), (2, 2), (2, 2)]
    assert all(r.wall_s > 0 and r.forward_s > 0 and r.thread_cpu_s >= 0 for r in records)
    assert all(b.start >= a.start + a.wall_s for a, b in zip(records, records[1:]))
