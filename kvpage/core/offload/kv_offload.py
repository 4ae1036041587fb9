"""Which KV blocks move between the pool and the lower tiers (decisions only; no bytes move).

Tiers, fastest first: the pool (tier 1, the ``RadixCache``), host memory (tier 2) and
local disk (tier 3), each with its own LRU. Both lower tiers are keyed by the block hash
chain (``block_hash``), as vLLM's offloading connector does: after a restart the disk
holds hashes only, so a lookup past the radix tree walks the request's hash chain.

Policy:
  * host tier: a victim cache of the pool. A cached block evicted from the pool is stored
    to the host tier (unless it already holds the hash); a load keeps the host copy, so a
    block that is evicted again costs no second copy.
  * disk tier: write-through. Every full block of a successful step is saved unless the
    disk already holds it, so the disk mirrors the cache across restarts; disk entries are
    LRU-evicted (their files deleted) to stay within the size cap.
  * a prefix hit past the pool: host blocks are loaded into fresh pool blocks before the
    step's forward; disk-only blocks are first read into host slots in the background
    (the request waits, holding no pool blocks) and then load like host hits.
  * a request waiting for disk reads holds the host entries of its hit (``hold``) until it
    is admitted or ends (``release``): what it waited for, and the host blocks before it,
    cannot be evicted by the pool evictions of the steps it waits through. A store that
    finds every host slot pinned is dropped instead.

A disk tier opened read-only serves what it holds and saves nothing. The step's plan is
collected while the scheduler works and handed out once (``take_step_transfers``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kvpage.core.block_hash import BlockHash
from kvpage.core.kv_events import MEDIUM_DISK, MEDIUM_HOST, KVEventLog
from kvpage.core.offload.kv_transfers import DiskOp, KVTransfers
from kvpage.core.offload.tier_pool import TierEntry, TierPool


@dataclass(frozen=True, slots=True)
class TierLookup:
    """A chain of blocks past the pool, split at the first block that is not in host memory.

    ``ready``: leading hashes whose KV is in the host tier (loadable now). ``fetch``: the
    disk-only hashes after them, and ``pending``: hashes being read from disk right now;
    waiting for both lets the chain continue past ``ready``.
    """

    ready: tuple[BlockHash, ...] = ()
    fetch: tuple[BlockHash, ...] = ()
    pending: tuple[BlockHash, ...] = ()


class KVOffloadManager:
    """The host and disk tiers' indexes, and the per-step transfer plan (see the module doc)."""

    def __init__(self, block_size: int, num_host_blocks: int, num_disk_blocks: int = 0,
                 events: Optional[KVEventLog] = None) -> None:
        self.block_size = block_size
        self.host = TierPool("host", num_host_blocks)
        self.disk = TierPool("disk", num_disk_blocks) if num_disk_blocks else None
        self.disk_writable = self.disk is not None
        self.events = events or KVEventLog()
        self._stores: dict[int, tuple[int, BlockHash]] = {}  # host slot -> (pool block, hash), this step
        self._store_slot: dict[BlockHash, int] = {}  # the reverse of _stores
        self._loads: list[tuple[int, int]] = []  # (host slot, pool block), this step
        self._load_pins: list[BlockHash] = []
        self._fetches: list[tuple[BlockHash, int]] = []
        # owner -> the host entries it holds; an entry is kept by identity, so a hold on an
        # entry that was removed (a failed read, a clear) and later re-created releases nothing.
        self._holds: dict[str, list[tuple[BlockHash, TierEntry]]] = {}
        self.counters = dict.fromkeys(("host_stores", "host_loads", "disk_loads", "disk_fetches",
                                       "disk_fetch_failures", "disk_saves", "disk_save_failures"), 0)

    # ------------------------------------------------------------------ pool eviction -> host
    def on_pool_evict(self, block_hash: BlockHash, block_id: int, token_ids: Sequence[int],
                      parent_hash: Optional[BlockHash]) -> None:
        """The pool is evicting cached block ``block_id``: keep its KV in the host tier."""
        if block_hash in self.host:
            self.host.touch(block_hash)  # the host copy (ready or being read) is the same KV
            return
        slot, evicted = self.host.allocate(block_hash)
        self._host_evicted(evicted)
        if slot is None:
            return  # every host slot is pinned by a transfer: the KV is dropped
        self._stores[slot] = (block_id, block_hash)
        self._store_slot[block_hash] = slot
        self.counters["host_stores"] += 1
        self.events.stored([block_hash], parent_hash, token_ids, self.block_size, MEDIUM_HOST)

    def _host_evicted(self, hashes: list[BlockHash]) -> None:
        for block_hash in hashes:
            # A store planned this step into the slot being reused must not land after the
            # slot's new owner is written (a background disk read could be that owner).
            slot = self._store_slot.pop(block_hash, None)
            if slot is not None:
                del self._stores[slot]
        self.events.removed(hashes, MEDIUM_HOST)

    # ------------------------------------------------------------------ lookups and loads
    def lookup(self, hashes: Sequence[BlockHash]) -> TierLookup:
        """Split the chain ``hashes`` (the blocks after the pool's match) as ``TierLookup`` says."""
        ready: list[BlockHash] = []
        rest: list[tuple[BlockHash, str]] = []
        for block_hash in hashes:
            entry = self.host.entry(block_hash)
            if entry is not None:
                kind = "ready" if entry.ready else "pending"
            elif self.disk is not None and self.disk.lookup(block_hash) is not None:
                kind = "fetch"
            else:
                break
            if kind == "ready" and not rest:
                ready.append(block_hash)
            else:
                rest.append((block_hash, kind))
        return TierLookup(tuple(ready), tuple(h for h, k in rest if k == "fetch"),
                          tuple(h for h, k in rest if k == "pending"))

    def pin_for_load(self, hashes: Sequence[BlockHash]) -> None:
        """Protect the host entries of ``hashes`` from eviction until the step is handed out."""
        for block_hash in hashes:
            self.host.pin(block_hash)
        self._load_pins.extend(hashes)

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            self.host.unpin(block_hash)
            self._load_pins.remove(block_hash)

    def plan_loads(self, hashes: Sequence[BlockHash], pool_blocks: Sequence[int]) -> None:
        """Copy the (pinned) host entries of ``hashes`` into the fresh ``pool_blocks`` this step."""
        for block_hash, block_id in zip(hashes, pool_blocks):
            entry = self.host.entry(block_hash)
            self._loads.append((entry.slot, block_id))
            self.counters["disk_loads" if entry.from_disk else "host_loads"] += 1
            entry.from_disk = False
            self.host.touch(block_hash)
            if self.disk is not None:
                self.disk.touch(block_hash)

    # ------------------------------------------------------------------ holds
    def hold(self, owner: str, hashes: Sequence[BlockHash]) -> None:
        """Pin the host entries of ``hashes`` (ready or being read) for ``owner`` until
        ``release(owner)``; hashes without a host entry are skipped. Adds to earlier holds."""
        held = self._holds.setdefault(owner, [])
        for block_hash in hashes:
            entry = self.host.entry(block_hash)
            if entry is not None:
                self.host.pin(block_hash)
                held.append((block_hash, entry))

    def holders(self) -> list[str]:
        """The owners holding host entries."""
        return list(self._holds)

    def release(self, owner: str) -> None:
        """Drop ``owner``'s holds (a no-op for an owner holding nothing)."""
        for block_hash, entry in self._holds.pop(owner, ()):
            if self.host.entry(block_hash) is entry:
                self.host.unpin(block_hash)

    # ------------------------------------------------------------------ disk reads
    def start_fetches(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Reserve host slots and plan background reads of the disk-only ``hashes``.

        Returns the hashes whose read was started (a prefix: it stops when every host slot
        is pinned). Each one completes through ``complete_fetch``.
        """
        started: list[BlockHash] = []
        for block_hash in hashes:
            if block_hash in self.host or self.disk is None or self.disk.lookup(block_hash) is None:
                continue
            slot, evicted = self.host.allocate(block_hash, ready=False)
            self._host_evicted(evicted)
            if slot is None:
                break
            self.host.pin(block_hash)  # the reader writes the slot
            self.disk.pin(block_hash)  # the file must outlive the read
            self.disk.touch(block_hash)
            self._fetches.append((block_hash, slot))
            started.append(block_hash)
        self.counters["disk_fetches"] += len(started)
        return started

    def complete_fetch(self, block_hash: BlockHash, ok: bool) -> None:
        """A background read finished: the host entry becomes loadable, or both entries go."""
        if self.disk is not None:
            self.disk.unpin(block_hash)
        entry = self.host.entry(block_hash)
        if entry is None or entry.ready:
            return  # the tiers were cleared while it was under way
        self.host.unpin(block_hash)
        if ok:
            entry.ready = entry.from_disk = True
            self.host.touch(block_hash)
            self.events.stored([block_hash], None, (), self.block_size, MEDIUM_HOST)
            return
        self.host.remove(block_hash)
        self.counters["disk_fetch_failures"] += 1
        if self.disk is not None and self.disk.remove(block_hash) is not None:
            self.events.removed([block_hash], MEDIUM_DISK)

    # ------------------------------------------------------------------ disk writes
    def plan_saves(self, blocks: Sequence[tuple[BlockHash, int, Optional[BlockHash], Sequence[int]]]) -> list[DiskOp]:
        """Write-through: disk ops saving each ``(hash, pool block, parent hash, token ids)``
        the disk lacks, with the LRU removals that make room, in order."""
        if self.disk is None or not self.disk_writable:
            return []
        ops: list[DiskOp] = []
        for block_hash, block_id, parent, token_ids in blocks:
            if block_hash in self.disk:
                self.disk.touch(block_hash)
                continue
            slot, evicted = self.disk.allocate(block_hash)
            ops += [DiskOp("remove", h) for h in evicted]
            self.events.removed(evicted, MEDIUM_DISK)
            if slot is None:
                continue  # every entry is pinned by a read
            ops.append(DiskOp("save", block_hash, block_id))
            self.events.stored([block_hash], parent, token_ids, self.block_size, MEDIUM_DISK)
        self.counters["disk_saves"] += sum(1 for op in ops if op.kind == "save")
        return ops

    def complete_save_failure(self, block_hash: BlockHash) -> None:
        """A planned save could not be written (disk full, read-only, I/O error): forget it."""
        self.counters["disk_save_failures"] += 1
        entry = self.disk.entry(block_hash) if self.disk is not None else None
        if entry is not None and entry.pins == 0:
            self.disk.remove(block_hash)
            self.events.removed([block_hash], MEDIUM_DISK)

    def restore_disk(self, hashes_oldest_first: Sequence[BlockHash]) -> list[DiskOp]:
        """Index entries found on disk at start-up; returns removals past the size cap."""
        if self.disk is None:
            return []
        ops: list[DiskOp] = []
        for block_hash in hashes_oldest_first:
            if block_hash not in self.disk:
                _, evicted = self.disk.allocate(block_hash)
                ops += [DiskOp("remove", h) for h in evicted]
        self.events.stored(self.disk.ready_hashes(), None, (), self.block_size, MEDIUM_DISK)
        return ops

    # ------------------------------------------------------------------ the step's plan
    def take_step_transfers(self) -> Optional[KVTransfers]:
        """The copies planned since the last call (None if none); releases the load pins."""
        for block_hash in self._load_pins:
            self.host.unpin(block_hash)
        self._load_pins = []
        if not (self._stores or self._loads or self._fetches):
            return None
        stores = [(block, slot) for slot, (block, _) in self._stores.items()]
        transfers = KVTransfers(np.asarray(stores, dtype=np.int64).reshape(-1, 2),
                                np.asarray(self._loads, dtype=np.int64).reshape(-1, 2), self._fetches,
                                [h for _, h in self._stores.values()])
        self._stores, self._store_slot, self._loads, self._fetches = {}, {}, [], []
        return transfers

    def discard_stores(self, transfers: KVTransfers) -> None:
        """The copies of a step failed: its host stores hold nothing valid."""
        gone = [h for h in transfers.store_hashes if self.host.remove(h) is not None]
        self.events.removed(gone, MEDIUM_HOST)

    def clear(self) -> list[BlockHash]:
        """Forget every host and disk entry; returns the disk hashes (files to delete).

        Host entries a disk read is still filling stay until the read reports (their slots
        are being written).
        """
        for owner in list(self._holds):
            self.release(owner)
        self.host.clear(keep_pending=True)
        self._stores, self._store_slot, self._loads, self._load_pins, self._fetches = {}, {}, [], [], []
        return self.disk.clear() if self.disk is not None else []

    # ------------------------------------------------------------------ checks and stats
    def check_integrity(self) -> None:
        """Assert free + used == total per tier, and that every host pin has an owner: a
        pending entry's read holds one, a planned load one, each live hold one."""
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.check_integrity()
        expected = {h: int(not self.host.entry(h).ready) for h in self.host.hashes()}
        for block_hash in self._load_pins:
            expected[block_hash] += 1
        for held in self._holds.values():
            for block_hash, entry in held:
                if self.host.entry(block_hash) is entry:
                    expected[block_hash] += 1
        for block_hash, pins in expected.items():
            assert self.host.entry(block_hash).pins == pins, \
                f"host block {block_hash.hex()[:16]}: {self.host.entry(block_hash).pins} pins, {pins} owned"

    def stats(self) -> dict:
        disk = self.disk
        stats = {"kv_host_blocks": self.host.num_slots, "kv_host_used_blocks": self.host.num_used_slots,
                 "kv_host_evictions": self.host.num_evictions,
                 "kv_disk_blocks": disk.num_slots if disk else 0,
                 "kv_disk_used_blocks": disk.num_used_slots if disk else 0,
                 "kv_disk_evictions": disk.num_evictions if disk else 0}
        stats.update({f"kv_{name}": value for name, value in self.counters.items()})
        return stats
