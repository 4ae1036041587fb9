"""Prometheus families of the KV tiers (pool, host, disk), read from engine statistics.

Next to the existing ``kvpage:`` metrics, labelled by ``tier``; present only when the engine
has lower tiers. Counters are cumulative over the engine's life; the latency histograms
come from ``KVTierAgent`` (``kv_tier_latency`` in ``stats()``), seconds per transfer batch.
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_COUNTERS = {  # name: (doc, {tier label: stats key})
    "kvpage:kv_tier_hits": ("Prompt tokens served from each KV tier instead of recomputed (every admission).",
                            {"pool": "kv_pool_hit_tokens", "host": "kv_host_hit_tokens", "disk": "kv_disk_hit_tokens"}),
    "kvpage:kv_tier_loaded_bytes": ("Bytes of KV read from a lower tier.",
                                    {"host": "kv_host_loaded_bytes", "disk": "kv_disk_read_bytes"}),
    "kvpage:kv_tier_stored_bytes": ("Bytes of KV written to a lower tier.",
                                    {"host": "kv_host_stored_bytes", "disk": "kv_disk_written_bytes"}),
    "kvpage:kv_tier_evictions": ("KV blocks evicted from each tier (LRU).",
                                 {"pool": "kv_pool_evictions", "host": "kv_host_evictions",
                                  "disk": "kv_disk_evictions"}),
}
_GAUGES = {
    "kvpage:kv_tier_capacity_blocks": ("KV blocks each lower tier holds at most.",
                                       {"host": "kv_host_blocks", "disk": "kv_disk_blocks"}),
    "kvpage:kv_tier_used_blocks": ("KV blocks each lower tier holds now.",
                                   {"host": "kv_host_used_blocks", "disk": "kv_disk_used_blocks"}),
}
_HISTOGRAMS = {
    "kvpage:kv_tier_load_seconds": ("Seconds per load from a lower tier (host: one step's copies; disk: one block).",
                                    {"host": "host_load", "disk": "disk_load"}),
    "kvpage:kv_tier_store_seconds": ("Seconds per store to a lower tier (host: one step's copies; disk: one block).",
                                     {"host": "host_store", "disk": "disk_store"}),
}
ERROR_KINDS = ("corrupt", "missing", "full", "read_only", "io", "dropped")


def tier_families(stats: dict) -> Iterator:
    """The tier metric families for one ``stats()`` snapshot (nothing without tiers)."""
    if "kv_host_blocks" not in stats:
        return
    for families, kind in ((_COUNTERS, CounterMetricFamily), (_GAUGES, GaugeMetricFamily)):
        for name, (doc, keys) in families.items():
            family = kind(name, doc, labels=["tier"])
            for tier, key in keys.items():
                family.add_metric([tier], float(stats.get(key, 0)))
            yield family
    errors = CounterMetricFamily("kvpage:kv_disk_errors", "Disk tier failures, each recomputed instead "
                                 "(corrupt, missing, full, read_only, io, dropped).", labels=["kind"])
    for kind in ERROR_KINDS:
        errors.add_metric([kind], float(stats.get(f"kv_disk_errors_{kind}", 0)))
    yield errors
    latency = stats.get("kv_tier_latency", {})
    for name, (doc, keys) in _HISTOGRAMS.items():
        family = HistogramMetricFamily(name, doc, labels=["tier"])
        for tier, key in keys.items():
            snap = latency.get(key)
            if snap is not None:
                buckets = [("+Inf" if bound == float("inf") else repr(bound), count)
                           for bound, count in snap["buckets"]]
                family.add_metric([tier], buckets, snap["sum"])
        yield family
