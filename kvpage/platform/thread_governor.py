"""Fewer compute threads while another process keeps some of our CPUs busy.

Every parallel region of torch and numba waits for its slowest thread. When a neighbour
process takes half of one of our two cores, the thread sharing that core runs at half
speed and every region takes twice as long, while its partner spins: the engine falls to
about a third of its idle throughput, below what one thread on the free core gives. The
governor watches, between steps, how much of the CPUs this process may use is busy with
*other* work (``/proc/stat`` for those CPUs minus ``/proc/self/stat``), and sets torch and
numba to the cores left over, rounded, between 1 and the engine's configured count. A new
count must be seen on two checks in a row before it applies, so a short burst elsewhere
does not make it flap; only the look the engine takes when it starts applies at once.

Only when the engine sized its threads itself (no ``num_threads`` given) and
``KVPAGE_THREAD_GOVERNOR`` is not ``0``; Linux only. Dynamo guards a compiled graph on the
thread count it was compiled with, so a compiled engine makes a second entry at start-up for
one thread fewer (its kernels read the count at run time, so that entry loads the first's
code from the cache) and its governor moves only between those two counts (``counts``):
never a compile mid-run. Torch-free at import.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional, Sequence

log = logging.getLogger("kvpage")

#: Seconds between two looks at the CPU counters. A change takes two looks in a row, so a
#: neighbour that starts with the engine costs about two intervals at the old count.
CHECK_INTERVAL_S = 0.25
#: Seconds of the look an engine takes when it starts (``ThreadGovernor.first_look``): the
#: counters tick 100 times a second, so this is 40 ticks over two CPUs.
FIRST_LOOK_S = 0.2
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (idle and iowait are not busy)


def read_cpu_busy_ticks(cpus: Sequence[int], stat_path: str = "/proc/stat") -> int:
    """Busy clock ticks summed over ``cpus`` (steal included: the host took them)."""
    wanted = {f"cpu{c}" for c in cpus}
    total = 0
    with open(stat_path) as f:
        for line in f:
            name, *fields = line.split()
            if name in wanted:
                total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return total


def read_own_ticks(stat_path: str = "/proc/self/stat") -> int:
    """utime + stime of this process (all its threads), in clock ticks."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), after pid and comm


def threads_for(num_cpus: int, others_busy_cores: float, max_threads: int) -> int:
    """Threads that fit beside ``others_busy_cores`` of other work: the free cores, rounded."""
    free = num_cpus - max(0.0, others_busy_cores)
    return max(1, min(max_threads, int(free + 0.5)))


def nearest_allowed(target: int, counts: Optional[Sequence[int]]) -> int:
    """``target`` itself, or with ``counts`` the largest of them not above it (else the smallest)."""
    if not counts:
        return target
    below = [c for c in counts if c <= target]
    return max(below) if below else min(counts)


class ThreadGovernor:
    """Call ``tick()`` between steps; it adjusts ``apply(count)`` at most every ``interval_s``,
    to one of ``counts`` when given (the thread counts a compiled graph has entries for)."""

    def __init__(self, max_threads: int, apply: Callable[[int], None], cpus: Optional[Sequence[int]] = None,
                 interval_s: float = CHECK_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 read_busy: Callable[[Sequence[int]], int] = read_cpu_busy_ticks,
                 read_own: Callable[[], int] = read_own_ticks, counts: Optional[Sequence[int]] = None) -> None:
        self.max_threads = max_threads
        self.counts = tuple(sorted(set(counts))) if counts else None
        self.current = max_threads
        self._apply = apply
        self._cpus = list(cpus if cpus is not None else sorted(os.sched_getaffinity(0)))
        self._interval = interval_s
        self._clock, self._read_busy, self._read_own = clock, read_busy, read_own
        self._hz = os.sysconf("SC_CLK_TCK")
        self._pending: Optional[int] = None
        self._last = self._sample()  # the first window starts now, not at the first step
        self.num_changes = 0

    def _sample(self) -> tuple:
        return self._clock(), self._read_busy(self._cpus), self._read_own()

    def tick(self) -> int:
        """Look at the counters if ``interval_s`` has passed; returns the thread count in use."""
        now = self._clock()
        if now - self._last[0] < self._interval:
            return self.current
        previous = self._last
        self._last = self._sample()
        target, others = self._wanted(previous, self._last)
        if target == self.current:
            self._pending = None
        elif target == self._pending:
            self._change(target, others)
        else:
            self._pending = target
        return self.current

    def first_look(self, window_s: float = FIRST_LOOK_S, sleep: Callable[[float], None] = time.sleep) -> int:
        """At start-up: watch the counters for ``window_s`` and apply the count they ask for at
        once, without waiting for a second look (an engine started beside a busy neighbour
        would otherwise run its first two intervals at the full count); returns the count in use."""
        start = self._sample()
        sleep(window_s)
        self._last = self._sample()
        target, others = self._wanted(start, self._last)
        if target != self.current:
            self._change(target, others)
        return self.current

    def _wanted(self, previous: tuple, sample: tuple) -> tuple:
        """The count the window between two samples asks for, and the cores others kept busy."""
        seconds = max(sample[0] - previous[0], 1e-9)
        others = ((sample[1] - previous[1]) - (sample[2] - previous[2])) / (self._hz * seconds)
        return nearest_allowed(threads_for(len(self._cpus), others, self.max_threads), self.counts), others

    def _change(self, target: int, others: float) -> None:
        log.info("compute threads: %d -> %d (%.1f of %d CPUs busy with other work)", self.current, target,
                 others, len(self._cpus))
        self._apply(target)
        self.current, self._pending = target, None
        self.num_changes += 1


def governor_wanted(requested: Optional[int], count: int) -> bool:
    """Whether an engine that resolved ``count`` threads (the user asked for ``requested``)
    gets a governor: it chose the count itself, there is a count to lower, and the platform
    and ``KVPAGE_THREAD_GOVERNOR`` allow it."""
    if requested is not None or os.environ.get("KVPAGE_NUM_THREADS") or count < 2:
        return False
    return os.environ.get("KVPAGE_THREAD_GOVERNOR", "1") != "0" and os.path.exists("/proc/self/stat")


def governor_for(requested: Optional[int], count: int, apply: Callable[[int], None],
                 counts: Optional[Sequence[int]] = None) -> Optional[ThreadGovernor]:
    """A governor when ``governor_wanted``, else None; ``counts`` as ``ThreadGovernor``'s. It
    takes its first look before it returns (``FIRST_LOOK_S`` of start-up)."""
    if not governor_wanted(requested, count):
        return None
    try:
        governor = ThreadGovernor(count, apply, counts=counts)
    except (OSError, AttributeError):
        return None
    governor.first_look()
    return governor
