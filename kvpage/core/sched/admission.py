"""Admission: waiting requests join the running set while the step's budget, ``max_num_seqs``
and the pool allow.

Each consults the prefix cache first, so cached tokens are never recomputed; without chunked
prefill a prompt runs whole or waits. A request asking ``prompt_logprobs`` skips the lookup
until its prompt is done (``policy.uses_prefix_cache``). A hit that continues on disk parks
the request (``TierScheduling.park_for_disk``) instead, once. Token regions of an admitted
request::

    |<- hit.num_tokens (pool + host) ->|<- num_new: this step's chunk ->|<- later chunks ->|
    0                                                                             num_tokens
"""
from __future__ import annotations

import bisect
from typing import Optional

from kvpage.core.config import SchedulerConfig
from kvpage.core.kv.kv_cache_manager import KVCacheManager
from kvpage.core.kv.prefix_hits import NO_HIT
from kvpage.core.kv.radix_cache import RadixCache
from kvpage.core.kv.radix_node import PrefixMatch
from kvpage.core.request import Request, RequestStatus
from kvpage.core.sched.policy import seats, sort_key, uses_prefix_cache
from kvpage.core.sched.step_plan import StepPlan
from kvpage.core.sched.tier_scheduling import TierScheduling
from kvpage.core.sched.waiting_queue import WaitingQueue


class Admission:
    """Moves requests from ``waiting`` into a running list, in queue order; stops at the first
    that does not fit (no skipping ahead: the head would starve)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, waiting: WaitingQueue,
                 prefix_cache: Optional[RadixCache], tiers: Optional[TierScheduling]) -> None:
        self.config = config
        self.kv = kv
        self.waiting = waiting
        self.prefix_cache = prefix_cache
        self.tiers = tiers

    def admit(self, plan: StepPlan, running: list[Request]) -> None:
        """Admit into ``running`` (kept sorted) and ``plan`` while ``plan.budget`` lasts."""
        max_seqs = self.config.max_num_seqs
        # Seats, not running requests: one still prefilling with ``n`` samples forks into
        # ``n`` after its first token, and those seats must be free then.
        taken = sum(seats(r) for r in running)
        while plan.budget > 0 and taken < max_seqs:
            request = self.waiting.peek()
            if request is None or taken + seats(request) > max_seqs:
                break
            uses_cache = uses_prefix_cache(request)
            hit = self.kv.match_prefix(request) if uses_cache else NO_HIT
            if hit.waits_for_disk and not request.kv_fetch_waited:
                self.waiting.pop()
                self.tiers.park_for_disk(request, hit)
                continue
            num_new = self._chunk(request, hit, plan.budget)
            if num_new is None or not self.kv.allocate_slots(request, num_new, hit):
                break
            self._start(request, hit, uses_cache, running)
            taken += seats(request)
            plan.add(request, num_new, self.kv)

    def _chunk(self, request: Request, hit: PrefixMatch, budget: int) -> Optional[int]:
        """Tokens of ``request`` to run this step after ``hit``; None if they must wait."""
        num_new = request.num_tokens - hit.num_tokens
        if self.config.enable_chunked_prefill:
            return min(num_new, budget)
        return None if num_new > budget else num_new

    def _start(self, request: Request, hit: PrefixMatch, uses_cache: bool, running: list[Request]) -> None:
        """Move the queue's head, whose slots are allocated, into ``running``."""
        self.waiting.pop()
        if request.kv_fetch_waited and self.tiers is not None:
            self.tiers.admitted(request)
        if self.prefix_cache is not None and not request.prefix_queried and uses_cache:
            # Count each request once: a recompute after preemption hits its own blocks.
            request.prefix_queried = True
            self.prefix_cache.record_query(request.num_tokens, hit.num_tokens)
        request.status = RequestStatus.RUNNING
        bisect.insort(running, request, key=sort_key)
