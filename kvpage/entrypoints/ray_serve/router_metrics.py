"""What the prefix-aware router measured, for the ingress's ``/metrics``.

The router runs inside the ingress's process (Ray Serve routes on the caller's side of a
deployment handle), on a loop of its own, so the two share this one process-wide object;
prometheus_client's metrics are thread-safe and the per-replica texts are replaced whole.

- ``kvpage:router_requests{rule}``: requests routed, by the rule that ranked the replicas
  (``prefix_policy``: imbalanced, prefix, miss; "unkeyed" for requests without a prompt key).
- ``kvpage:router_prompt_tokens`` / ``kvpage:router_estimated_hit_tokens``: prompt tokens
  routed, and how many of them the chosen replica was believed to cache.
- ``kvpage:router_prefix_hit_rate_estimate``: their ratio (0 before any request).
- ``kvpage:ingress_replica_failures{outcome}``: requests whose replica died under them, by
  what the ingress did: ``retried`` (nothing had reached the client), ``gave_up`` (503 after
  the last attempt), ``in_stream`` (an in-band error ended a started stream).
- every replica's own metrics (``kvpage serve``'s), as last reported, with a ``replica`` label.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families


class _HitRateCollector:
    def __init__(self, metrics: "RouterMetrics") -> None:
        self._metrics = metrics

    def collect(self):
        yield GaugeMetricFamily("kvpage:router_prefix_hit_rate_estimate",
                                "Estimated share of routed prompt tokens cached on the chosen replica (0-1).",
                                value=self._metrics.hit_rate_estimate())


class _ReplicaCollector:
    """Re-exports each replica's last reported exposition text with a ``replica`` label."""

    def __init__(self, metrics: "RouterMetrics") -> None:
        self._metrics = metrics

    def collect(self):
        merged: dict[str, Metric] = {}
        for replica, text in sorted(self._metrics.replica_texts().items()):
            for family in text_string_to_metric_families(text):
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    out.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value,
                                   sample.timestamp, sample.exemplar)
        yield from merged.values()


class RouterMetrics:
    """One registry: routing counters, the hit-rate estimate and the replicas' metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvpage:router_requests", "Requests routed, by rule.", ["rule"], registry=self.registry)
        self.prompt_tokens = Counter("kvpage:router_prompt_tokens", "Prompt tokens of routed requests.",
                                     registry=self.registry)
        self.hit_tokens = Counter("kvpage:router_estimated_hit_tokens",
                                  "Prompt tokens believed cached on the replica each request was sent to.",
                                  registry=self.registry)
        self.replica_failures = Counter("kvpage:ingress_replica_failures",
                                        "Requests whose replica died under them, by what the ingress did.",
                                        ["outcome"], registry=self.registry)
        self.registry.register(_HitRateCollector(self))
        self.registry.register(_ReplicaCollector(self))
        self._lock = threading.Lock()
        self._replica_texts: dict[str, str] = {}
        self._totals = [0, 0]  # prompt tokens, estimated hit tokens

    def observe(self, rule: str, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.requests.labels(rule).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.hit_tokens.inc(num_hit_tokens)
        with self._lock:
            self._totals[0] += num_prompt_tokens
            self._totals[1] += num_hit_tokens

    def hit_rate_estimate(self) -> float:
        with self._lock:
            queried, hits = self._totals
        return hits / queried if queried else 0.0

    def set_replica_texts(self, texts: dict[str, str]) -> None:
        with self._lock:
            self._replica_texts = dict(texts)

    def replica_texts(self) -> dict[str, str]:
        with self._lock:
            return dict(self._replica_texts)


ROUTER_METRICS = RouterMetrics()
