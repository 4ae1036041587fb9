"""What one ``Scheduler.schedule()`` call has decided so far; lives only for that call."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvpage.core.kv.kv_cache_manager import KVCacheManager
from kvpage.core.request import Request


@dataclass(slots=True)
class StepPlan:
    """The step's token ``budget`` left, the ``(request, tokens)`` scheduled in order (``num_tokens``
    of them in all), the requests preempted, and the blocks newly cached for the step (head
    first per request)."""

    budget: int
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    newly_cached: list[int] = field(default_factory=list)

    def add(self, request: Request, num_new: int, kv: KVCacheManager) -> None:
        """Run ``num_new`` tokens of ``request`` (its slots are allocated) and offer the blocks
        they fill to the prefix cache."""
        self.scheduled.append((request, num_new))
        self.budget -= num_new
        self.num_tokens += num_new
        if (request.num_computed_tokens + num_new) // kv.block_size > request.num_inserted_blocks:
            self.newly_cached.extend(kv.cache_scheduled_blocks(request, num_new))

    def cap(self, limit: int) -> None:
        """Let the whole step hold at most ``limit`` tokens (never raises the budget)."""
        self.budget = max(0, min(self.budget, limit - self.num_tokens))

    def scheduled_ids(self) -> set[int]:
        """``id`` of every request scheduled so far."""
        return {id(r) for r, _ in self.scheduled}
