"""Per-step timings of an engine: where a step's wall time goes, and how much of it the
engine thread spent off the CPU.

A diagnostic for the question "what does serving cost beyond the forward?": the same
workload's steps offline (``LLM``) and behind ``kvpage serve`` (the engine thread shares
the interpreter with the HTTP event loop) are compared by their records. Each record holds
the step's phases (schedule, forward, post-processing: sampling, scheduler update, output
deltas) in wall seconds, the engine thread's CPU seconds over the step
(``time.thread_time``) and the whole process's (``time.process_time``). Wall minus the
engine thread's CPU is time that thread did not run: waiting for the interpreter lock, or
descheduled by the OS. The process's CPU minus the engine thread's is every other thread's
work in that window (compute-pool workers, the event loop, tokenizers).

``KVPAGE_STEP_TIMELINE=FILE`` makes every engine of the process record its steps
(``timeline_from_env``) and write them as JSON lines to ``FILE`` when it closes or the
process exits (several engines: ``FILE`` gets a ``.N`` suffix from the second on).
Recording costs twelve clock reads a step (three clocks at four marks). ``summarize``
reduces records to means per kind of step.
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Iterable, Optional

#: Steps kept (the newest); a long server run keeps its last ones.
DEFAULT_CAPACITY = 200_000
_instances = itertools.count()


@dataclass
class StepRecord:
    """One non-empty step. Times in seconds; ``start`` on ``time.perf_counter``'s clock."""
    start: float
    schedule_s: float
    forward_s: float
    post_s: float
    thread_cpu_s: float
    process_cpu_s: float
    num_seqs: int
    num_tokens: int

    @property
    def wall_s(self) -> float:
        return self.schedule_s + self.forward_s + self.post_s

    @property
    def decode_only(self) -> bool:
        """Every sequence of the step advanced by one token (no prompt tokens)."""
        return self.num_tokens == self.num_seqs


class StepTimeline:
    """Records steps: ``mark()`` at each phase boundary, then ``record``."""

    def __init__(self, path: Optional[str] = None, capacity: int = DEFAULT_CAPACITY) -> None:
        self.path = path
        self.records: deque[StepRecord] = deque(maxlen=capacity)

    @staticmethod
    def mark() -> tuple[float, float, float]:
        """(wall, this thread's CPU, the process's CPU) now."""
        return time.perf_counter(), time.thread_time(), time.process_time()

    def record(self, begin: tuple, scheduled: tuple, forwarded: tuple, end: tuple, num_seqs: int,
               num_tokens: int) -> None:
        self.records.append(StepRecord(begin[0], scheduled[0] - begin[0], forwarded[0] - scheduled[0],
                                       end[0] - forwarded[0], end[1] - begin[1], end[2] - begin[2],
                                       num_seqs, num_tokens))

    def dump(self) -> None:
        """Write the records to ``path`` as JSON lines (nothing without a path)."""
        if self.path is None:
            return
        with open(self.path, "w") as f:
            for rec in self.records:
                f.write(json.dumps(asdict(rec)) + "\n")


def timeline_from_env() -> Optional[StepTimeline]:
    """A timeline writing to ``$KVPAGE_STEP_TIMELINE`` (a ``.N`` suffix after the first
    engine), or None when it is unset."""
    path = os.environ.get("KVPAGE_STEP_TIMELINE")
    if not path:
        return None
    n = next(_instances)
    timeline = StepTimeline(path if n == 0 else f"{path}.{n}")
    atexit.register(timeline.dump)  # an engine that is never closed still leaves its steps
    return timeline


def load(path: str) -> list[StepRecord]:
    with open(path) as f:
        return [StepRecord(**json.loads(line)) for line in f if line.strip()]


def summarize(records: Iterable[StepRecord], num_seqs: Optional[int] = None) -> dict[str, dict]:
    """Means per kind of step ("decode" steps hold no prompt tokens, "mixed" do), over the
    steps of ``num_seqs`` sequences when given: count, wall / schedule / forward / post ms,
    the engine thread's CPU ms and its off-CPU ms (wall minus CPU), the other threads' CPU
    ms, and the gap ms from the previous recorded step's end (the loop's work between steps)."""
    ordered = sorted(records, key=lambda r: r.start)
    gaps = {id(r): (r.start - (p.start + p.wall_s)) for p, r in zip(ordered, ordered[1:])}
    out: dict[str, dict] = {}
    for kind in ("decode", "mixed"):
        chosen = [r for r in ordered if r.decode_only == (kind == "decode")
                  and (num_seqs is None or r.num_seqs == num_seqs)]
        if not chosen:
            continue
        n = len(chosen)

        def mean_ms(values: Iterable[float], count: int = n) -> float:
            return 1e3 * sum(values) / max(count, 1)

        with_gap = [gaps[id(r)] for r in chosen if id(r) in gaps]
        out[kind] = {
            "steps": n,
            "mean_seqs": sum(r.num_seqs for r in chosen) / n,
            "mean_tokens": sum(r.num_tokens for r in chosen) / n,
            "wall_ms": mean_ms(r.wall_s for r in chosen),
            "schedule_ms": mean_ms(r.schedule_s for r in chosen),
            "forward_ms": mean_ms(r.forward_s for r in chosen),
            "post_ms": mean_ms(r.post_s for r in chosen),
            "engine_cpu_ms": mean_ms(r.thread_cpu_s for r in chosen),
            "engine_off_cpu_ms": mean_ms(max(0.0, r.wall_s - r.thread_cpu_s) for r in chosen),
            "other_threads_cpu_ms": mean_ms(max(0.0, r.process_cpu_s - r.thread_cpu_s) for r in chosen),
            "gap_ms": mean_ms(with_gap, len(with_gap)),
        }
    return out
