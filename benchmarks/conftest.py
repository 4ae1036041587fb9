"""Shared setup for the CPU benchmarks: one thread count for torch and numba alike."""
from __future__ import annotations

import os

import pytest


def bench_threads() -> int:
    """Threads for every backend: ``KVPAGE_BENCH_THREADS`` or all cores."""
    return int(os.environ.get("KVPAGE_BENCH_THREADS", os.cpu_count() or 1))


@pytest.fixture(scope="session", autouse=True)
def _same_threads_everywhere():
    torch = pytest.importorskip("torch")
    numba = pytest.importorskip("numba")
    n = bench_threads()
    torch.set_num_threads(n)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    yield
