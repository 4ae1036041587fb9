"""The prefix-aware routing rule, as a pure function of what the replicas reported.

Inputs per replica: the set of block hashes its radix cache holds (``RadixCache.block_hashes``,
reported every ``request_routing_stats_period_s``, plus the blocks of requests the router
sent it since that report) and its load (requests in flight there). Input per request: the
chained hashes of its prompt's full blocks (``core.block_hash.prompt_block_hashes``).

The rule, in order:

1. **Imbalanced** -- ``max(load) - min(load) > imbalance_threshold`` requests: rank replicas
   by load only (least loaded first). A hot prefix must not pile every request on one
   replica while another idles.
2. **Prefix hit** -- some replica caches at least ``min_match_fraction`` of the prompt's
   full blocks (leading ones, at least one): the replicas with the longest cached prefix come
   first (least loaded among them), the rest follow by load. The fraction keeps a short
   preamble every prompt shares (a chat template's header, a common first sentence) from
   pulling all traffic to one replica.
3. **Miss** -- nobody caches the prefix: least loaded first; ties go to the replica holding
   the fewest cached blocks, so new prefixes spread over the cluster.

Loads are what the Ray Serve request router tracks (its queue-length cache); a replica
that rejects the request (``max_ongoing_requests`` reached) makes Serve try the next rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Hashable, Sequence

DEFAULT_IMBALANCE_THRESHOLD = 8
DEFAULT_MIN_MATCH_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router knows about one replica: its id, cached block hashes (and how many), in-flight requests."""

    replica_id: Hashable
    cached: Container[int]
    num_cached: int
    load: int


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Replica ids best first, the rule that ranked them, and the prompt blocks cached on the first."""

    ranking: tuple
    rule: str  # "imbalanced", "prefix" or "miss"
    matched_blocks: int


def matched_blocks(prompt_hashes: Sequence[int], cached: Container[int]) -> int:
    """How many leading blocks of the prompt ``cached`` holds (chained hashes: stop at the first gap)."""
    count = 0
    for block_hash in prompt_hashes:
        if block_hash not in cached:
            break
        count += 1
    return count


def rank_replicas(prompt_hashes: Sequence[int], replicas: Sequence[ReplicaView],
                  imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                  min_match_fraction: float = DEFAULT_MIN_MATCH_FRACTION) -> RoutingDecision:
    """Apply the module's rule; ``replicas`` must not be empty."""
    if not replicas:
        raise ValueError("no replica to route to")
    loads = [r.load for r in replicas]
    by_load = sorted(replicas, key=lambda r: (r.load, r.num_cached))
    matches = {r.replica_id: matched_blocks(prompt_hashes, r.cached) for r in replicas}
    if max(loads) - min(loads) > imbalance_threshold:
        return RoutingDecision(tuple(r.replica_id for r in by_load), "imbalanced", matches[by_load[0].replica_id])
    best = max(matches.values())
    if best >= max(1.0, min_match_fraction * len(prompt_hashes)):
        ranked = sorted(replicas, key=lambda r: (-matches[r.replica_id], r.load))
        return RoutingDecision(tuple(r.replica_id for r in ranked), "prefix", best)
    return RoutingDecision(tuple(r.replica_id for r in by_load), "miss", 0)
