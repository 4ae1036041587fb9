"""One compute thread count for the whole engine, sized once from what this process may use.

torch (its OpenMP pool) and numba (the CPU attention kernels) each keep a thread pool. Left
alone, each sizes itself to every core of the machine, ignoring CPU affinity and cgroup
quotas, and on a small machine the two pools oversubscribe the cores they share. The
engine therefore sets both to the same count once, at start-up:

* ``EngineConfig.num_threads`` (``--num-threads``) when given;
* else ``KVPAGE_NUM_THREADS`` from the environment;
* else the CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU
  quota (``/sys/fs/cgroup/cpu.max``), at least 1.

Both pools are GNU OpenMP here; ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` are left at their
defaults unless the user sets them. While another process keeps some of those CPUs busy,
``thread_governor`` lowers the count between steps.

Handing the forward to another thread (a server's engine thread): GNU OpenMP keeps one
worker pool per thread that ever started a parallel region, and while it manages more
threads than there are CPUs it stops spinning between regions, so every region then waits
for its workers to wake from the kernel. ``release_thread_pools`` frees the calling
thread's idle pools before the hand-off, and ``set_compute_threads`` must run in the new
thread too, since numba's count is per thread. Torch-free at import.
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
    """Set numba's and torch's thread counts (numba's applies to the calling thread).

    Numba first: its first ``set_num_threads`` launches its OpenMP pool, which calls
    ``omp_set_num_threads`` with numba's full count, and torch reads that same OpenMP
    setting. Set the other way round, the first engine of a process asked for fewer threads
    than CPUs ran torch on all of them."""
    try:
        import numba

        numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    try:
        import torch

        torch.set_num_threads(count)
    except ImportError:
        pass


#: Shared-object names of the OpenMP runtimes torch and numba may load.
_OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")
#: Runtimes whose pause frees only the calling thread's pool (GNU's ``gomp_pause_host``);
#: LLVM's and Intel's pause the whole runtime, unsafe while another engine thread is inside
#: a parallel region, so they are left alone.
_PER_THREAD_PAUSE = ("libgomp",)
_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the runtime's state


def loaded_openmp_runtimes(maps_path: str = "/proc/self/maps") -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (torch bundles its own copy of
    libgomp, numba's ``omp`` layer links the system's), in first-mapped order; [] off Linux."""
    try:
        with open(maps_path) as f:
            lines = f.readlines()
    except OSError:
        return []
    paths: list[str] = []
    for line in lines:
        path = line.split()[-1] if line.strip() else ""
        if path.startswith("/") and os.path.basename(path).startswith(_OPENMP_RUNTIMES) and path not in paths:
            paths.append(path)
    return paths


def release_thread_pools() -> int:
    """Free the OpenMP worker threads the *calling* thread owns, in every loaded GNU OpenMP
    runtime (``omp_pause_resource_all``, OpenMP 5.0); returns how many released them. Call
    it in the thread that loaded and warmed up the model, before another thread runs the
    steps (see the module docstring). A later parallel region in this thread builds a new
    pool, so it is safe at any time outside a parallel region."""
    import ctypes

    released = 0
    for path in loaded_openmp_runtimes():
        if not os.path.basename(path).startswith(_PER_THREAD_PAUSE):
            continue
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all  # the already-loaded copy: same handle
        except (OSError, AttributeError):
            continue
        pause.restype, pause.argtypes = ctypes.c_int, [ctypes.c_int]
        if pause(_OMP_PAUSE_SOFT) == 0:
            released += 1
    return released


def configure_threads(requested: Optional[int] = None) -> int:
    """Give torch and numba the same thread count; returns it. Safe to call again."""
    count = resolve_num_threads(requested)
    set_compute_threads(count)
    log.info("compute threads: %d (torch and numba)", count)
    return count

