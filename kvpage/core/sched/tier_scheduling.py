"""The scheduler's side of the lower KV tiers: parked requests, completions and disk saves.

``Scheduler.tiers`` is one of these when the cache has lower tiers. The engine (or any
driver of the core) calls, once per step:

    complete_fetches(results)   before ``schedule``: finished disk reads ``(hash, ok)``;
                                requests waiting for them queue again (also the timeouts)
    complete_saves(failed)      disk writes that failed: the disk index forgets them
    admitted(request) / ended(request)
                                a request that waited for disk reads got its blocks, or
                                ended: the host entries it held may be evicted again
    take_saves(output)          after a successful step: the disk writes it needs
    discard_transfers(output)   when the step's tier copies raised

``park_for_disk`` is the scheduler's: a waiting request whose prefix continues on disk
leaves the queue while the blocks are read (``FetchWaits``).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

from kvpage.core.block_hash import BlockHash
from kvpage.core.sched.fetch_waits import FetchWaits
from kvpage.core.kv.kv_cache_manager import KVCacheManager
from kvpage.core.offload.kv_offload import KVOffloadManager
from kvpage.core.offload.kv_transfers import DiskOp
from kvpage.core.kv.radix_node import PrefixMatch
from kvpage.core.request import Request, RequestStatus
from kvpage.core.sched.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from kvpage.core.sched.output import SchedulerOutput


class TierScheduling:
    """Ties a ``KVOffloadManager`` to the scheduler's queue and block tables."""

    def __init__(self, offload: KVOffloadManager, kv: KVCacheManager, waiting: WaitingQueue,
                 fetch_waits: FetchWaits) -> None:
        self.offload = offload
        self.kv = kv
        self.waiting = waiting
        self.fetch_waits = fetch_waits

    def park_for_disk(self, request: Request, hit: PrefixMatch) -> None:
        """Start reading the hit's disk-only blocks; the (popped) request waits off the queue."""
        started = self.offload.start_fetches(hit.fetch_hashes)
        awaited = set(started) | {h for h in hit.pending_hashes if h in self.offload.host}
        if awaited:
            # Hold what it waits for and the host blocks before it: the pool evictions of
            # the steps it waits through would otherwise push them out of the host tier.
            self.offload.hold(request.request_id, [*hit.load_hashes, *awaited])
            self.fetch_waits.park(request, awaited, time.monotonic())
        else:  # nothing could be started: admit it with what the pool and host hold
            request.kv_fetch_waited = True
            self.waiting.push_front(request)

    def complete_fetches(self, results: Sequence[tuple[BlockHash, bool]]) -> None:
        """Report finished disk reads ``(block hash, ok)``; requests waiting on them queue again.

        Also releases requests past their wait deadline: call it once per step, results or not.
        """
        for block_hash, ok in results:
            self.offload.complete_fetch(block_hash, ok)
        if len(self.fetch_waits):
            self.release(self.fetch_waits.resolve((h for h, _ in results), time.monotonic()))

    def admitted(self, request: Request) -> None:
        """``request`` got its blocks (its loads are pinned for the step): drop its holds."""
        self.offload.release(request.request_id)

    def ended(self, request: Request) -> None:
        """``request`` ended before admission: stop waiting for it and drop its holds."""
        self.fetch_waits.discard(request.request_id)
        self.offload.release(request.request_id)

    def release(self, requests: Sequence[Request]) -> None:
        for request in reversed(requests):  # the earliest ends up first in line
            self.waiting.push_front(request)

    def take_saves(self, output: "SchedulerOutput") -> list[DiskOp]:
        """After ``output``'s step succeeded: the disk writes that keep the disk tier a
        mirror of the cache (its full blocks that are still cached), with LRU removals."""
        if self.offload.disk is None or not output.newly_cached_blocks:
            return []
        return self.kv.plan_disk_saves(output.newly_cached_blocks[::-1])

    def complete_saves(self, failed: Sequence[BlockHash]) -> None:
        """Report disk writes that failed: the disk tier forgets them."""
        for block_hash in failed:
            self.offload.complete_save_failure(block_hash)

    def discard_transfers(self, output: "SchedulerOutput") -> None:
        """The step's tier copies failed: forget what they stored (``Scheduler.discard_step_cache``
        forgets the pool blocks they loaded)."""
        if output.kv_transfers is not None:
            self.offload.discard_stores(output.kv_transfers)

    def restore_disk(self, hashes_oldest_first: Sequence[BlockHash], writable: bool = True) -> list[DiskOp]:
        """Index the disk tier's entries found at start-up; returns the removals past its cap.

        ``writable`` False: the disk serves what it holds and saves nothing.
        """
        if self.offload.disk is None:
            return []
        self.offload.disk_writable = writable
        return self.offload.restore_disk(hashes_oldest_first)

    def clear(self) -> list[BlockHash]:
        """Empty the lower tiers and release parked requests; returns the disk hashes dropped."""
        dropped = self.offload.clear()
        self.release(self.fetch_waits.resolve((), float("inf")))
        return dropped

    def stats(self, block_size: int) -> dict:
        stats = self.offload.stats()
        stats.update(kv_pool_hit_tokens=self.kv.num_pool_hit_tokens,
                     kv_host_hit_tokens=stats["kv_host_loads"] * block_size,
                     kv_disk_hit_tokens=stats["kv_disk_loads"] * block_size,
                     num_waiting_for_disk=len(self.fetch_waits))
        return stats

    def check_integrity(self) -> None:
        """Assert the tiers balance, every parked request is waiting, off the queue, blockless,
        and only requests not yet admitted hold host entries."""
        self.offload.check_integrity()
        for owner in self.offload.holders():
            assert owner in self.fetch_waits or owner in self.waiting, f"request {owner!r} holds host entries"
        for request in self.fetch_waits:
            assert request.status is RequestStatus.WAITING and not request.block_ids
            assert request.request_id not in self.waiting, f"{request!r} is both queued and parked"
