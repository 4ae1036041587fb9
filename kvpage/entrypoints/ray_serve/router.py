"""``PrefixAwareRequestRouter``: a Ray Serve ``RequestRouter`` over the replicas' real cache state.

Each ``KVPageReplica`` reports, through Serve's ``record_routing_stats`` hook (polled every
``request_routing_stats_period_s``), the chained block hashes its radix cache holds. The
ingress computes the same hashes for the request's prompt and passes them, with the
prompt's length, as the ``routing_key`` keyword (a ``routing_key.RoutingKey``), which this
router reads from the ``PendingRequest``; ``prefix_policy.rank_replicas`` ranks the replicas.

A report lags by up to one period, so a burst of requests of a new prefix would all look
like misses and scatter. The router therefore also counts, as cached on a replica, the
prompt blocks of requests it sent there in the last ``speculative_ttl_s`` seconds (they
are being prefilled there). A replica's load is the number of requests this router has in
flight on it (ranked first and not yet routed, or routed and not completed).

Keyword arguments (``request_router_kwargs``): ``imbalance_threshold``, ``min_match_fraction``
(see ``prefix_policy``), ``speculative_ttl_s``.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvpage.entrypoints.ray_serve.prefix_policy import (DEFAULT_IMBALANCE_THRESHOLD, DEFAULT_MIN_MATCH_FRACTION, ReplicaView, matched_blocks,
                            rank_replicas)
from kvpage.entrypoints.ray_serve.routing_key import RoutingKey

_MAX_RESERVATIONS = 10_000


def _shared_metrics():
    """The process's one ``RouterMetrics``, looked up when used: Serve may ship this class by value
    with copies of its module's globals, and the ingress must read the object the router writes."""
    from kvpage.entrypoints.ray_serve import router_metrics

    return router_metrics.ROUTER_METRICS


class _CachedView:
    """Reported hashes plus unexpired speculative ones; supports ``in``."""

    __slots__ = ("reported", "speculative", "now")

    def __init__(self, reported: frozenset, speculative: dict, now: float) -> None:
        self.reported, self.speculative, self.now = reported, speculative, now

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.reported or self.speculative.get(block_hash, 0.0) > self.now


class PrefixAwareRequestRouter(RequestRouter):
    """Longest cached prefix first, least loaded when loads are imbalanced (see ``prefix_policy``)."""

    def initialize_state(self, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                         min_match_fraction: float = DEFAULT_MIN_MATCH_FRACTION, speculative_ttl_s: float = 3.0,
                         **_: Any) -> None:
        self._imbalance_threshold = int(imbalance_threshold)
        self._min_match_fraction = float(min_match_fraction)
        self._speculative_ttl_s = float(speculative_ttl_s)
        # replica id -> (the reported list object, its hashes as a set): rebuilt once per report
        self._reported: dict[ReplicaID, tuple[Any, frozenset]] = {}
        self._speculative: dict[ReplicaID, dict[int, float]] = defaultdict(dict)  # hash -> expiry
        self._in_flight: dict[ReplicaID, int] = defaultdict(int)
        # internal request id -> (replica ranked first, rule, estimated hit tokens, time): counted
        # in that replica's load from ranking until routed (see ``_reserve``)
        self._reservations: dict[str, tuple] = {}

    # ------------------------------------------------------------------ state
    def _reported_hashes(self, replica: RunningReplica) -> frozenset:
        hashes = (replica.routing_stats or {}).get("block_hashes") or ()
        cached = self._reported.get(replica.replica_id)
        if cached is None or cached[0] is not hashes:
            cached = self._reported[replica.replica_id] = (hashes, frozenset(hashes))
        return cached[1]

    def _view(self, replica: RunningReplica, now: float) -> ReplicaView:
        reported = self._reported_hashes(replica)
        speculative = self._speculative[replica.replica_id]
        return ReplicaView(replica.replica_id, _CachedView(reported, speculative, now),
                           len(reported) + len(speculative), self._in_flight[replica.replica_id])

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for table in (self._reported, self._speculative, self._in_flight):
            for replica_id in [k for k in table if k not in live]:
                del table[replica_id]
        _shared_metrics().set_replica_texts({r.replica_id.unique_id: (r.routing_stats or {}).get("metrics_text", "")
                                          for r in replicas})

    # ------------------------------------------------------------------ routing
    @staticmethod
    def _prompt_key(pending_request: Optional[PendingRequest]) -> RoutingKey:
        key = (pending_request.kwargs or {}).get("routing_key") if pending_request is not None else None
        return key if isinstance(key, RoutingKey) else RoutingKey.empty()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = self._prompt_key(pending_request)
        now = time.monotonic()
        if pending_request is not None:
            self._release(pending_request.metadata.internal_request_id)  # an earlier try of this request
        decision = rank_replicas(key.block_hashes, [self._view(r, now) for r in candidate_replicas],
                                 self._imbalance_threshold, self._min_match_fraction)
        if pending_request is not None:
            self._reserve(pending_request.metadata.internal_request_id, decision.ranking[0],
                          decision.rule if key.block_hashes else "unkeyed", key, now)
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[replica_id]] for replica_id in decision.ranking]

    def _reserve(self, request_id: str, replica_id: ReplicaID, rule: str, key: RoutingKey, now: float) -> None:
        """Count the request on its first choice at once: Serve may rank several pending requests
        before any of them is routed, and they must not all see the same idle replica."""
        if len(self._reservations) > _MAX_RESERVATIONS:  # requests that were never routed (cancelled)
            for stale in [r for r, res in self._reservations.items() if now - res[3] > 120.0]:
                self._release(stale)
        replica = self.curr_replicas.get(replica_id)
        hit_tokens = 0
        if replica is not None and key.block_hashes:
            hit_tokens = matched_blocks(key.block_hashes, self._view(replica, now).cached) * key.block_size
        self._reservations[request_id] = (replica_id, rule, min(hit_tokens, key.num_prompt_tokens), now)
        self._in_flight[replica_id] += 1
        speculative = self._speculative[replica_id]
        for block_hash in key.block_hashes:
            speculative[block_hash] = now + self._speculative_ttl_s
        if len(speculative) > 4 * len(key.block_hashes) + 1024:  # drop expired entries now and then
            for block_hash in [h for h, t in speculative.items() if t <= now]:
                del speculative[block_hash]

    def _release(self, request_id: str) -> Optional[tuple]:
        reservation = self._reservations.pop(request_id, None)
        if reservation is not None and self._in_flight.get(reservation[0], 0) > 0:
            self._in_flight[reservation[0]] -= 1
        return reservation

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        key = self._prompt_key(pending_request)
        reservation = self._release(pending_request.metadata.internal_request_id)
        if reservation is None or reservation[0] != replica_id:  # sent elsewhere than ranked first
            self._reserve("", replica_id, reservation[1] if reservation else "unkeyed", key, time.monotonic())
            reservation = self._release("")
        self._in_flight[replica_id] += 1  # until on_request_completed
        _shared_metrics().observe(reservation[1], key.num_prompt_tokens, reservation[2])

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._in_flight.get(replica_id, 0) > 0:
            self._in_flight[replica_id] -= 1
