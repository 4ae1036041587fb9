"""The periodic stats log line, computed from deltas of ``AsyncLLM.stats()``.

One INFO line on the ``kvpage`` logger every interval::

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s, Running: 12 reqs,
    Waiting: 0 reqs, KV cache usage: 3.1%, KV fragmentation: 9.8%, Prefix cache hit rate: 52.0%,
    Preemptions: 0 (total 0)

Throughputs and the hit rate cover the interval only (prompt tokens are counted when a
request is accepted; the hit rate is 0.0% when no prompt was looked up); usage,
fragmentation and the queue are as of the end of the interval. An idle server logs one
idle line and then stays quiet until something happens.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

log = logging.getLogger("kvpage")

_COUNTERS = ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions")


def stats_line(before: dict, after: dict, elapsed_s: float) -> str:
    """The log line for the interval from ``before`` to ``after`` (two ``stats()`` dicts)."""
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in _COUNTERS}
    seconds = max(elapsed_s, 1e-9)
    queries = delta["prefix_cache_queries"]
    hit_rate = delta["prefix_cache_hits"] / queries if queries > 0 else 0.0
    return (f"Avg prompt throughput: {delta['prompt_tokens'] / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {delta['generation_tokens'] / seconds:.1f} tokens/s, "
            f"Running: {after.get('num_running', 0)} reqs, Waiting: {after.get('num_waiting', 0)} reqs, "
            f"KV cache usage: {100 * after.get('kv_cache_usage', 0.0):.1f}%, "
            f"KV fragmentation: {100 * after.get('kv_fragmentation', 0.0):.1f}%, "
            f"Prefix cache hit rate: {100 * hit_rate:.1f}%, "
            f"Preemptions: {delta['num_preemptions']} (total {after.get('num_preemptions', 0)})")


def is_idle(before: dict, after: dict) -> bool:
    """Nothing ran in the interval and nothing is queued or running at its end."""
    unchanged = all(after.get(key, 0) == before.get(key, 0) for key in _COUNTERS)
    return unchanged and not after.get("num_running", 0) and not after.get("num_waiting", 0)


async def log_stats_forever(read_stats: Callable[[], dict], interval_s: float) -> None:
    """Log ``stats_line`` every ``interval_s`` seconds until cancelled."""
    before, then, quiet = read_stats(), time.monotonic(), False
    while True:
        await asyncio.sleep(interval_s)
        after, now = read_stats(), time.monotonic()
        idle = is_idle(before, after)
        if not (idle and quiet):
            log.info("%s", stats_line(before, after, now - then))
        before, then, quiet = after, now, idle
