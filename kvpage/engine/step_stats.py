"""Running aggregates over an engine's steps (for ``stats()``, demos and benchmarks)."""
from __future__ import annotations

from kvpage.core.sched.output import SchedulerOutput

from kvpage.core.sched.scheduler import Scheduler


class StepStats:
    """A step observer: KV usage, fragmentation and concurrency of every step that ran."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.reset()

    def reset(self) -> None:
        """Forget the steps seen so far (e.g. after a warm-up)."""
        self.num_steps = 0
        self.usage_sum = 0.0
        self.fragmentation_sum = 0.0
        self.peak_usage = 0.0
        self.peak_running = 0

    def record(self, output: SchedulerOutput) -> None:
        pool = self.scheduler.pool
        self.num_steps += 1
        self.usage_sum += pool.usage
        self.fragmentation_sum += pool.fragmentation
        self.peak_usage = max(self.peak_usage, pool.usage)
        self.peak_running = max(self.peak_running, self.scheduler.num_running)

    def summary(self) -> dict:
        steps = max(self.num_steps, 1)
        return {"num_steps": self.num_steps, "mean_kv_cache_usage": self.usage_sum / steps,
                "mean_kv_fragmentation": self.fragmentation_sum / steps,
                "peak_kv_cache_usage": self.peak_usage, "peak_num_running": self.peak_running}
