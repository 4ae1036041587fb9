"""A fixed-bucket latency histogram that a background thread may feed (for ``stats()``).

Prometheus-shaped: cumulative counts per upper bound, plus the sum and count, so the
server's collector can expose it as a histogram without owning the observations.
"""
from __future__ import annotations

import bisect
import threading

#: Upper bounds in seconds: a host copy takes tens of microseconds, a disk read milliseconds.
TRANSFER_BUCKETS_S = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)


class LatencyHistogram:
    def __init__(self, buckets: tuple = TRANSFER_BUCKETS_S) -> None:
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, seconds)] += 1
            self._sum += seconds

    def snapshot(self) -> dict:
        """``{"buckets": [(upper bound, cumulative count), ...], "sum": s, "count": n}``; the
        last bound is ``float("inf")``."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip(self.buckets + (float("inf"),), counts):
            running += count
            cumulative.append((bound, running))
        return {"buckets": cumulative, "sum": total, "count": running}
