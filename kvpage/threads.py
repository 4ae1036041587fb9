"""One compute thread count for the whole engine, sized once from what this process may use.

torch (its OpenMP pool) and numba (the CPU attention kernels) each keep a thread pool. Left
alone, each sizes itself to every core of the machine, ignoring CPU affinity and cgroup
quotas, and on a small machine the two pools oversubscribe the cores they share. The
engine therefore sets both to the same count once, at start-up:

* ``EngineConfig.num_threads`` (``--num-threads``) when given;
* else ``KVPAGE_NUM_THREADS`` from the environment;
* else the CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU
  quota (``/sys/fs/cgroup/cpu.max``), at least 1.

Spinning: both pools are GNU OpenMP here (two copies of it), whose idle workers spin
before they sleep. ``OMP_WAIT_POLICY=PASSIVE`` made no difference on an idle machine and
``GOMP_SPINCOUNT`` tuning helped idle but collapsed under a competing process, so the
defaults are left alone; both variables are honoured when the user sets them. While another
process keeps some of those CPUs busy, ``thread_governor`` lowers the count between steps.
Torch-free at import.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Optional

log = logging.getLogger("kvpage")


def available_cpus(cpu_max_path: str = "/sys/fs/cgroup/cpu.max") -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    try:
        quota, period = open(cpu_max_path).read().split()[:2]
        if quota != "max":
            count = min(count, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, count)


def resolve_num_threads(requested: Optional[int] = None) -> int:
    """The engine's thread count (see the module docstring for the precedence)."""
    if requested is not None:
        return int(requested)
    env = os.environ.get("KVPAGE_NUM_THREADS")
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"KVPAGE_NUM_THREADS must be a positive integer, got {env!r}") from None
        if value <= 0:
            raise ValueError(f"KVPAGE_NUM_THREADS must be a positive integer, got {env!r}")
        return value
    return available_cpus()


def set_compute_threads(count: int) -> None:
    """Set torch's and numba's thread counts (numba's applies to the calling thread)."""
    try:
        import torch

        torch.set_num_threads(count)
    except ImportError:
        pass
    try:
        import numba

        numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass


def configure_threads(requested: Optional[int] = None) -> int:
    """Give torch and numba the same thread count; returns it. Safe to call again."""
    count = resolve_num_threads(requested)
    set_compute_threads(count)
    log.info("compute threads: %d (torch and numba)", count)
    return count

