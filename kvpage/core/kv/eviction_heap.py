"""The prefix cache's LRU eviction order: a min-heap with lazy invalidation.

An entry ``(last access, tiebreak, node, group)`` says "``node`` (group 0: the whole leaf;
group ``g`` >= 1: its sliding block of group ``g``) was idle at that access stamp". Entries
are never removed when they go stale (the node was touched, gained a child, got locked or
left the tree): the popper checks each against the tree and drops or requeues it, so one
eviction costs O(log n) instead of a rescan of every leaf.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Iterable, Iterator

from kvpage.core.kv.radix_node import RadixNode


class EvictionHeap:
    """Queued eviction candidates, oldest access first; may hold stale entries."""

    __slots__ = ("_entries", "_tiebreak")

    def __init__(self) -> None:
        self._entries: list[tuple[int, int, RadixNode, int]] = []  # (last access, tiebreak, node, group)
        self._tiebreak = itertools.count()  # nodes never compare: equal stamps pop in push order

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def push(self, node: RadixNode, group: int = 0) -> None:
        """Queue ``node`` (``group`` 0) or its sliding block of ``group`` at its current age."""
        heapq.heappush(self._entries, (node.last_access, next(self._tiebreak), node, group))

    def pop(self) -> tuple[int, RadixNode, int]:
        """The oldest entry: (access stamp when queued, node, group); it may be stale."""
        stamp, _, node, group = heapq.heappop(self._entries)
        return stamp, node, group

    def rebuild(self, candidates: Iterable[tuple[RadixNode, int]]) -> None:
        """Replace every entry by ``candidates`` ((node, group) pairs now idle), in O(n)."""
        self._entries = [(node.last_access, next(self._tiebreak), node, group) for node, group in candidates]
        heapq.heapify(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def queued(self) -> Iterator[tuple[int, int]]:
        """``(id(node), group)`` of every entry, stale ones included (for integrity checks)."""
        return ((id(node), group) for _, _, node, group in self._entries)
