"""The slots of one lower KV tier (host memory or local disk), keyed by block hash.

Each slot holds the KV of one full block. An entry is in one of three states::

    free      the slot holds nothing; on the free stack
    pending   reserved for a transfer still under way (a disk read); lookups skip it
    ready     holds a block's KV; ``lookup`` finds it

``pins`` protect an entry from eviction while a transfer reads or writes it. Eviction is
LRU over unpinned entries (an ``OrderedDict`` in access order, oldest first), so one
eviction is O(1) plus the pinned entries it steps over (a few in-flight transfers).
``num_free_slots + num_used_slots == num_slots`` always (``check_integrity``). Slots never
used yet are handed out from a counter, so a large tier costs no memory until it fills.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from kvpage.core.block_hash import BlockHash


@dataclass(slots=True)
class TierEntry:
    """Where one block's KV lives in the tier, and who protects it.

    ``from_disk``: the entry was read from the disk tier and has not been loaded since,
    so its first load counts as a disk hit.
    """

    slot: int
    ready: bool = True
    pins: int = 0
    from_disk: bool = False


class TierPool:
    """``num_slots`` block-sized slots of tier ``name``, with LRU eviction."""

    def __init__(self, name: str, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"{name} tier: num_slots must be a positive integer, got {num_slots!r}")
        self.name = name
        self.num_slots = num_slots
        self._free: list[int] = []  # slots given back; slots >= _fresh were never handed out
        self._fresh = 0
        self._entries: "OrderedDict[BlockHash, TierEntry]" = OrderedDict()
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_slots(self) -> int:
        return len(self._free) + self.num_slots - self._fresh

    @property
    def num_used_slots(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, block_hash: BlockHash) -> Optional[TierEntry]:
        """The entry of ``block_hash`` in any state, or None."""
        return self._entries.get(block_hash)

    def lookup(self, block_hash: BlockHash) -> Optional[int]:
        """The slot holding ``block_hash``'s KV, or None (absent or still pending)."""
        entry = self._entries.get(block_hash)
        return entry.slot if entry is not None and entry.ready else None

    def hashes(self) -> list[BlockHash]:
        """Every hash with an entry (ready or pending), least recently used first."""
        return list(self._entries)

    def ready_hashes(self) -> list[BlockHash]:
        """Hashes whose KV the tier holds, least recently used first."""
        return [h for h, e in self._entries.items() if e.ready]

    # ------------------------------------------------------------------ changes
    def touch(self, block_hash: BlockHash) -> None:
        """Mark ``block_hash`` most recently used (no-op if absent)."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)

    def allocate(self, block_hash: BlockHash, ready: bool = True) -> tuple[Optional[int], list[BlockHash]]:
        """Reserve a slot for ``block_hash``; returns (slot, hashes evicted to make room).

        The slot is None, and nothing changes, when the tier is full of pinned entries.
        Raises ``ValueError`` if ``block_hash`` already has an entry.
        """
        if block_hash in self._entries:
            raise ValueError(f"{self.name} tier already holds block {block_hash.hex()[:16]}")
        evicted: list[BlockHash] = []
        if not self.num_free_slots:
            victim = next((h for h, e in self._entries.items() if e.pins == 0), None)
            if victim is None:
                return None, []
            self.remove(victim)
            self.num_evictions += 1
            evicted.append(victim)
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._fresh = self._fresh, self._fresh + 1
        self._entries[block_hash] = TierEntry(slot, ready=ready)
        return slot, evicted

    def remove(self, block_hash: BlockHash) -> Optional[int]:
        """Drop ``block_hash``'s entry (pinned or not); returns its freed slot, or None if absent."""
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return None
        self._free.append(entry.slot)
        return entry.slot

    def pin(self, block_hash: BlockHash) -> None:
        self._entries[block_hash].pins += 1

    def unpin(self, block_hash: BlockHash) -> None:
        """Drop one pin; a no-op if the entry is gone (removed while a transfer was under way)."""
        entry = self._entries.get(block_hash)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def clear(self, keep_pending: bool = False) -> list[BlockHash]:
        """Drop every entry (with ``keep_pending``, all but those a transfer is still writing,
        whose slots must not be handed out again under it); returns the hashes dropped."""
        dropped = [h for h, e in self._entries.items() if not (keep_pending and not e.ready)]
        for block_hash in dropped:
            self.remove(block_hash)
        return dropped

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Assert free + used == total and that no slot is owned twice; raises AssertionError."""
        used = [e.slot for e in self._entries.values()]
        assert self.num_free_slots + len(used) == self.num_slots, f"{self.name}: slots leaked or double-counted"
        handed_out = set(used) | set(self._free)
        assert len(handed_out) == len(used) + len(self._free) == self._fresh, f"{self.name}: a slot is owned twice"
        assert all(0 <= s < self._fresh for s in handed_out)
        assert all(e.pins >= 0 for e in self._entries.values())
