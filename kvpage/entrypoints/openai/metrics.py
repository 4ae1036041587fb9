"""Prometheus metrics under vLLM's names with a ``kvpage:`` prefix.

Gauges and counters are read from engine statistics at scrape time (a custom
collector), so they can never drift from the engine. Latency histograms are fed by an
observer that the engine thread calls after every step.
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpage.engine.outputs import RequestOutput, StreamDelta

from kvpage.entrypoints.openai.tier_metrics import tier_families

GAUGES = {
    "kvpage:kv_cache_usage_perc": ("kv_cache_usage", "Fraction of KV blocks referenced by live requests (0-1)."),
    "kvpage:kv_cache_fragmentation_perc": ("kv_fragmentation",
                                           "Fraction of token slots in referenced KV blocks that hold no token (0-1)."),
    "kvpage:num_requests_running": ("num_running", "Requests in the running batch."),
    "kvpage:num_requests_waiting": ("num_waiting", "Requests waiting for admission."),
    "kvpage:num_free_blocks": ("num_free_blocks", "KV blocks no live request references."),
}
COUNTERS = {
    "kvpage:prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "kvpage:prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "kvpage:num_preemptions": ("num_preemptions", "Requests preempted (KV freed, to be recomputed)."),
    "kvpage:num_thrash_pins": ("num_thrash_pins", "Requests pinned against preemption after repeated preemptions."),
    "kvpage:prompt_tokens": ("prompt_tokens", "Prompt tokens accepted."),
    "kvpage:generation_tokens": ("generation_tokens", "Tokens generated."),
}
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _StatsCollector:
    def __init__(self, read_stats: Callable[[], dict]) -> None:
        self._read_stats = read_stats

    def collect(self):
        stats = self._read_stats()
        for name, (key, doc) in GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0)))
        for name, (key, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0)))
        yield from _group_families(stats.get("kv_groups") or [])
        yield from tier_families(stats)


def _group_families(groups: list) -> list:
    """Usage and fragmentation per KV group (labels: group index, and its attention window)."""
    usage = GaugeMetricFamily("kvpage:kv_group_usage_perc", "Fraction of all KV blocks held by the group's requests "
                              "(0-1).", labels=["group", "window"])
    fragmentation = GaugeMetricFamily("kvpage:kv_group_fragmentation_perc", "Fraction of token slots in the group's "
                                      "referenced blocks that hold no token (0-1).", labels=["group", "window"])
    for index, group in enumerate(groups):
        labels = [str(index), "full" if group["sliding_window"] is None else str(group["sliding_window"])]
        usage.add_metric(labels, float(group["usage"]))
        fragmentation.add_metric(labels, float(group["fragmentation"]))
    return [usage, fragmentation]


class ServerMetrics:
    """Owns one registry: the stats collector plus TTFT / ITL / end-to-end histograms."""

    def __init__(self, read_stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(read_stats))
        self.ttft = Histogram("kvpage:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("kvpage:inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kvpage:e2e_request_latency_seconds", "Arrival to finish of a request.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._last_token: dict[tuple[str, int], float] = {}

    def observe_step(self, deltas: list[StreamDelta], finished: dict[str, RequestOutput]) -> None:
        """Engine-thread hook: one call per step."""
        now = time.monotonic()
        for delta in deltas:
            if not delta.token_ids:
                continue
            key = (delta.request_id, delta.index)
            last = self._last_token.get(key)
            if last is not None:
                self.itl.observe(now - last)
            self._last_token[key] = now
            if delta.finish_reason is not None:
                self._last_token.pop(key, None)
        if len(self._last_token) > 100_000:  # aborted requests never finish: forget stale entries
            self._last_token = {k: t for k, t in self._last_token.items() if now - t < 600}
        for request_id, output in finished.items():
            m = output.metrics
            if m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
            for index in range(len(output.outputs)):
                self._last_token.pop((request_id, index), None)
