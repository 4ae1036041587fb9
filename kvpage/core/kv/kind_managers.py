"""One manager per kind of per-request KV: full attention, sliding window, recurrent state.

``KVCacheManager`` coordinates; each of these owns one kind of thing a request holds:

    FullAttentionManager    group ``g``'s block table, covering the whole context
    SlidingWindowManager    group ``g``'s block table, whose blocks behind the window go back
    RecurrentStateManager   the request's recurrent-state slot (``state_slots``)

All of them meet the ``KVKindManager`` protocol (give back, share with a fork); the two
block-table kinds add what grows a table (``GroupManager``). A block-table manager only
touches ``request.block_tables[g]`` and ``request.released_blocks[g]`` of its own group;
the request's shared counters (``num_computed_tokens``...) are the coordinator's.
"""
from __future__ import annotations

from typing import Optional, Protocol

from kvpage.core.kv.block_pool import BlockPool
from kvpage.core.kv.kv_groups import KVGroup, cdiv
from kvpage.core.kv.state_slots import StateSlotPool
from kvpage.core.request import Request


class KVKindManager(Protocol):
    """What the coordinator asks of every kind when a request ends or forks."""

    def free(self, request: Request) -> None:
        """Give back what ``request`` holds of this kind (the coordinator resets its tables)."""

    def fork(self, parent: Request, child: Request) -> None:
        """Let ``child`` share (or copy) what ``parent`` holds of this kind; may raise
        ``ValueError`` before changing anything."""


class GroupManager(KVKindManager, Protocol):
    """A block-table kind: what grows, fills and trims group ``index``'s table."""

    index: int

    def release_out_of_window(self, request: Request) -> None: ...
    def needs_copy(self, request: Request, num_new_tokens: int) -> bool: ...
    def copy_on_write(self, request: Request) -> None: ...
    def append_blocks(self, request: Request, num_blocks: int) -> None: ...
    def raise_fill(self, request: Request, start: int, end: int) -> None: ...
    def stats(self) -> dict: ...


class FullAttentionManager:
    """Block table of KV group ``index``, a full-attention group: it keeps the whole context."""

    __slots__ = ("index", "group", "pool", "block_size")

    def __init__(self, index: int, group: KVGroup, pool: BlockPool) -> None:
        self.index = index
        self.group = group
        self.pool = pool
        self.block_size = pool.block_size

    def release_out_of_window(self, request: Request) -> None:
        """Nothing leaves a full-attention window."""

    def needs_copy(self, request: Request, num_new_tokens: int) -> bool:
        """True when the new tokens land in a partially filled block that someone else
        also holds (copy-on-write)."""
        offset = request.num_computed_tokens % self.block_size
        table = request.block_tables[self.index]
        if num_new_tokens <= 0 or offset == 0 or not table:
            return False
        return self.pool.ref_count(table[request.num_computed_tokens // self.block_size]) > 1

    def copy_on_write(self, request: Request) -> None:
        """Swap the shared partial block that the next token lands in for a private copy;
        the (src, dst) copy joins ``request.pending_block_copies``."""
        table = request.block_tables[self.index]
        index = request.num_computed_tokens // self.block_size
        shared = table[index]
        (private,) = self.pool.allocate(1, self.index)
        self.pool.set_fill(private, self.pool.fill(shared))
        self.pool.free([shared])
        table[index] = private
        # A block id means the same tokens in every buffer, so one copy serves any group.
        request.pending_block_copies.append((shared, private))

    def append_blocks(self, request: Request, num_blocks: int) -> None:
        """Grow the table by ``num_blocks`` fresh blocks (the caller checked they are free)."""
        request.block_tables[self.index].extend(self.pool.allocate(num_blocks, self.index))

    def raise_fill(self, request: Request, start: int, end: int) -> None:
        """Record that token positions ``[start, end)`` hold tokens (per block, never per token)."""
        bs = self.block_size
        table = request.block_tables[self.index]
        for index in range(start // bs, cdiv(end, bs)):
            self.pool.raise_fill(table[index], min(end - index * bs, bs))

    def free(self, request: Request) -> None:
        """Drop the blocks held, tail first (the tail is evicted before the shared head)."""
        held = request.held_blocks(self.index)
        if held:
            self.pool.free(held[::-1])

    def fork(self, parent: Request, child: Request) -> None:
        """Take one more reference on each block ``parent`` holds (the coordinator copies the table)."""
        self.pool.incref(parent.held_blocks(self.index))

    def stats(self) -> dict:
        """The group's window, blocks held, share of the pool, and share of empty token slots."""
        g = self.index
        return {"sliding_window": self.group.sliding_window, "num_used_blocks": self.pool.tag_num_used_blocks(g),
                "usage": self.pool.tag_usage(g), "fragmentation": self.pool.tag_fragmentation(g)}


class SlidingWindowManager(FullAttentionManager):
    """Block table of a sliding-window group: blocks behind the window go back to the pool.

    Table of one request while it writes position ``p`` (window ``W``, ``bs`` = block_size)::

        | released (padding 0) | live: positions > p - W, up to p |
        0      (p - W + 1) // bs                        p // bs
    """

    __slots__ = ()

    def release_out_of_window(self, request: Request) -> None:
        """Give back the blocks wholly before the window of position ``num_computed_tokens``.

        A cached one stays in the prefix cache, evictable; the entries become padding.
        """
        table = request.block_tables[self.index]
        first = min(self.group.first_needed_block(request.num_computed_tokens, self.block_size), len(table))
        released = request.released_blocks[self.index]
        if first > released:
            self.pool.free(table[released:first])
            table[released:first] = [0] * (first - released)
            request.released_blocks[self.index] = first


def group_manager(index: int, group: KVGroup, pool: BlockPool) -> GroupManager:
    """The manager of KV group ``index``, chosen by its attention kind."""
    kind = SlidingWindowManager if group.is_sliding else FullAttentionManager
    return kind(index, group, pool)


class RecurrentStateManager:
    """Recurrent-state slots: a request holding blocks holds exactly one slot.

    The state covers exactly the computed tokens, so a slot is never shared: a fork gets a
    slot of its own, filled from its parent's before the next forward (``take_copies``).
    """

    __slots__ = ("slots", "pending_copies")

    def __init__(self, slots: StateSlotPool) -> None:
        self.slots = slots
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) slot copies owed by forks

    def has_room(self, request: Request) -> bool:
        """False when ``request`` has no slot and none is free."""
        return request.state_slot is not None or self.slots.num_free > 0

    def attach(self, request: Request) -> None:
        """Give ``request`` a slot unless it holds one (``has_room`` said there is one)."""
        if request.state_slot is None:
            request.state_slot = self.slots.allocate()

    def free(self, request: Request) -> None:
        if request.state_slot is not None:
            self.slots.free(request.state_slot)
            request.state_slot = None

    def fork(self, parent: Request, child: Request) -> None:
        slot: Optional[int] = self.slots.allocate()
        if slot is None:
            raise ValueError(f"cannot fork {parent.request_id!r}: every recurrent-state slot is held")
        child.state_slot = slot
        # Run before the next step's forward, whether or not the child runs in it: the
        # parent's state moves on at its next token. In fork order, so a fork of a fork
        # copies after its parent was filled.
        self.pending_copies.append((parent.state_slot, slot))

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) slot copies owed, in order; each is handed out once."""
        copies, self.pending_copies = self.pending_copies, []
        return copies
