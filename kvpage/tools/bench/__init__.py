"""``kvpage.tools.bench``: HF static batching vs HF continuous batching vs kvpage paged batching.

One run drives every configuration over the same seeded workload with the same KV memory
budget (bytes) and reports throughput, concurrency, KV waste, TTFT and ITL side by side.
Entry points: ``kvpage bench`` (see ``kvpage.entrypoints.cli.bench``) and ``python -m kvpage.tools.bench``.
Needs torch and transformers; never imported by ``import kvpage``.
"""
from __future__ import annotations

__all__ = ["run_suite"]


def __getattr__(name: str):
    if name == "run_suite":
        from kvpage.tools.bench.suite import run_suite

        return run_suite
    raise AttributeError(f"module 'kvpage.tools.bench' has no attribute {name!r}")
