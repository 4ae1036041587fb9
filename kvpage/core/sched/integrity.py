"""The request side of ``Scheduler.check_integrity``: request tables agree with the pool.

Run in tests and whenever the scheduler goes idle, so a leaked or doubly held block is
caught at the step that caused it.
"""
from __future__ import annotations

from typing import Collection

from kvpage.core.kv.kv_cache_manager import KVCacheManager
from kvpage.core.kv.state_slots import StateSlotPool
from kvpage.core.request import Request, RequestStatus


def check_block_holders(kv: KVCacheManager, requests: Collection[Request]) -> None:
    """Assert each live request's tables are well formed and every block's reference count
    equals the number of tables holding it; raises ``AssertionError``."""
    pool = kv.pool
    holders = [0] * pool.num_blocks
    for request in requests:
        for b in _held_blocks(kv, request):
            holders[b] += 1
    for b in range(pool.num_blocks):
        assert holders[b] == pool.ref_count(b), f"block {b}: {holders[b]} holders, ref {pool.ref_count(b)}"


def _held_blocks(kv: KVCacheManager, request: Request) -> list[int]:
    """Assert ``request``'s block tables are well formed; returns the blocks it holds."""
    if request.status is RequestStatus.WAITING:
        assert not request.block_ids, f"waiting {request!r} holds blocks"
    tables = request.block_tables
    assert request.status is RequestStatus.WAITING or len(tables) == kv.num_groups
    held: list[int] = []
    for g in range(len(tables)):
        assert len(tables[g]) == len(tables[0]), f"{request!r}: group tables of different lengths"
        assert request.released_blocks[g] <= kv.groups[g].first_needed_block(
            request.num_computed_tokens, kv.block_size), f"{request!r} released a block in its window"
        held += request.held_blocks(g)
    assert len(request.block_ids) * kv.block_size >= request.num_computed_tokens
    return held


def check_state_holders(slots: StateSlotPool, requests: Collection[Request]) -> None:
    """Assert each request holding blocks holds one state slot of its own, and no other does."""
    slots.check_integrity()
    held = [r.state_slot for r in requests if r.state_slot is not None]
    assert len(held) == len(set(held)) == slots.num_used, "state slots and holders disagree"
    for request in requests:
        assert (request.state_slot is not None) == bool(request.block_ids), \
            f"{request!r}: a state slot without blocks, or blocks without one"
