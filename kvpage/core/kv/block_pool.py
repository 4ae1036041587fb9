"""Fixed-size KV blocks with reference counts.

A block is in exactly one of three states::

    free        ref_count == 0, not cached      on the free stack, holds nothing useful
    cached-idle ref_count == 0, cached          holds a prefix the RadixCache may revive or evict
    in use      ref_count  > 0                  referenced by live requests (cached or not)

``num_free_blocks`` counts free + cached-idle blocks: both are available to a new
allocation, the latter after eviction. Allocation and free are O(1); when the free
stack runs dry the pool asks its evictor (the RadixCache) to release idle cached blocks.
Each block carries the tag it was allocated with (the KV group of a hybrid model), and
usage and fragmentation are kept per tag as well.
"""
from __future__ import annotations

import numbers
from collections import Counter
from typing import Iterable, Optional, Protocol, Sequence

import numpy as np


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free or evictable."""


class BlockEvictor(Protocol):
    """What the pool needs from a prefix cache."""

    def evict(self, num_blocks: int) -> int:
        """Release up to ``num_blocks`` cached-idle blocks back to the pool; return how many."""

    def on_block_idle(self, block_id: int) -> None:
        """Called when a cached block's last reference is dropped."""


class BlockPool:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` token slots each."""

    def __init__(self, num_blocks: int, block_size: int, num_tags: int = 1) -> None:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (num_blocks, block_size, num_tags)):
            raise ValueError(f"num_blocks, block_size and num_tags must be integers, got {num_blocks!r}, "
                             f"{block_size!r}, {num_tags!r}")
        if num_blocks <= 0 or block_size <= 0 or num_tags <= 0:
            raise ValueError(f"num_blocks, block_size and num_tags must be positive, got {num_blocks}, "
                             f"{block_size}, {num_tags}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_tags = num_tags
        self._tag = [0] * num_blocks  # what allocated it; kept while it is cached
        self._referenced_of_tag = [0] * num_tags
        self._fill_of_tag = [0] * num_tags
        # Reversed so that block 0 is handed out first (readable traces, no other meaning).
        self._free_stack: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_count = [0] * num_blocks
        self._cached = [False] * num_blocks
        self._fill = [0] * num_blocks  # token slots of the block that hold a token
        self._num_cached = 0
        self._num_cached_idle = 0
        self._num_referenced = 0
        self._referenced_fill = 0  # sum of _fill over referenced blocks
        self._evictor: Optional[BlockEvictor] = None

    # ------------------------------------------------------------------ wiring
    def set_evictor(self, evictor: Optional[BlockEvictor]) -> None:
        self._evictor = evictor

    # ------------------------------------------------------------------ counters
    @property
    def num_free_blocks(self) -> int:
        """Blocks no live request references: free plus cached-idle (evictable)."""
        return len(self._free_stack) + self._num_cached_idle

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one live request."""
        return self._num_referenced

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered with the prefix cache (idle or in use)."""
        return self._num_cached

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests, in [0, 1]."""
        return self._num_referenced / self.num_blocks

    @property
    def fragmentation(self) -> float:
        """Fraction of token slots in referenced blocks that hold no token, in [0, 1]."""
        slots = self._num_referenced * self.block_size
        return 0.0 if slots == 0 else 1.0 - self._referenced_fill / slots

    def tag_usage(self, tag: int) -> float:
        """Fraction of all blocks referenced by live requests under ``tag``."""
        return self._referenced_of_tag[tag] / self.num_blocks

    def tag_num_used_blocks(self, tag: int) -> int:
        return self._referenced_of_tag[tag]

    def tag_fragmentation(self, tag: int) -> float:
        """``fragmentation`` over the referenced blocks of ``tag``."""
        slots = self._referenced_of_tag[tag] * self.block_size
        return 0.0 if slots == 0 else 1.0 - self._fill_of_tag[tag] / slots

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_count[block_id]

    def is_cached(self, block_id: int) -> bool:
        self._check_id(block_id)
        return self._cached[block_id]

    def fill(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._fill[block_id]

    # ------------------------------------------------------------------ allocation
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int, tag: int = 0) -> list[int]:
        """Return ``num_blocks`` fresh blocks, each with ref_count 1, fill 0 and ``tag``.

        Raises ``NoFreeBlocksError`` (and changes nothing) if fewer are free or evictable.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an integer >= 0, got {num_blocks!r}")
        if isinstance(tag, bool) or not isinstance(tag, numbers.Integral) or not 0 <= tag < self.num_tags:
            raise ValueError(f"tag must be in [0, {self.num_tags}), got {tag!r}")
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"asked for {num_blocks} blocks, only {self.num_free_blocks} free of {self.num_blocks}"
            )
        shortfall = num_blocks - len(self._free_stack)
        if shortfall > 0:
            assert self._evictor is not None, "cached-idle blocks exist without an evictor"
            if self._evictor.evict(shortfall) < shortfall:
                # Cannot happen while the evictor keeps its contract (every cached-idle block
                # is evictable); fail loudly rather than pop from an empty stack.
                raise NoFreeBlocksError(f"the evictor released fewer than the {shortfall} idle blocks counted as free")
        blocks = [self._free_stack.pop() for _ in range(num_blocks)]
        for b in blocks:
            self._ref_count[b] = 1
            self._fill[b] = 0
            self._tag[b] = tag
        self._num_referenced += num_blocks
        self._referenced_of_tag[tag] += num_blocks
        return blocks

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each block (a prefix-cache hit or a fork).

        A cached-idle block is revived (locked): it can no longer be evicted.
        Raises ``ValueError`` (and changes nothing) on an unknown or free block.
        """
        block_ids = list(block_ids)
        for b in block_ids:  # validate everything first so a bad call changes nothing
            self._check_id(b)
            if self._ref_count[b] == 0 and not self._cached[b]:
                raise ValueError(f"block {b} is free; only cached or in-use blocks can gain a holder")
        for b in block_ids:
            rc = self._ref_count[b]
            if rc == 0:
                self._num_cached_idle -= 1
                self._num_referenced += 1
                self._referenced_fill += self._fill[b]
                tag = self._tag[b]
                self._referenced_of_tag[tag] += 1
                self._fill_of_tag[tag] += self._fill[b]
            self._ref_count[b] = rc + 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one holder from each block, in the order given.

        Pass a request's blocks tail-first so that, among cached blocks, the tail of a
        sequence becomes evictable before the head it shares with others.
        Raises ``ValueError`` on an unknown block or a block with no holder (double free).
        """
        # Validate everything first so a bad call changes nothing.
        if isinstance(block_ids, int):
            raise ValueError(f"free takes a sequence of block ids, got the int {block_ids}")
        for b, times in Counter(block_ids).items():
            self._check_id(b)
            if self._ref_count[b] < times:
                raise ValueError(f"double free of block {b}: it has {self._ref_count[b]} holder(s)")
        for b in block_ids:
            rc = self._ref_count[b] - 1
            self._ref_count[b] = rc
            if rc:
                continue
            self._num_referenced -= 1
            self._referenced_fill -= self._fill[b]
            tag = self._tag[b]
            self._referenced_of_tag[tag] -= 1
            self._fill_of_tag[tag] -= self._fill[b]
            if self._cached[b]:
                self._num_cached_idle += 1
                if self._evictor is not None:
                    self._evictor.on_block_idle(b)
            else:
                self._fill[b] = 0
                self._free_stack.append(b)

    def set_fill(self, block_id: int, num_tokens: int) -> None:
        """Record how many of the block's token slots hold a token (for fragmentation)."""
        self._check_id(block_id)
        if not 0 <= num_tokens <= self.block_size:
            raise ValueError(f"fill must be in [0, {self.block_size}], got {num_tokens}")
        if self._ref_count[block_id] > 0:
            self._referenced_fill += num_tokens - self._fill[block_id]
            self._fill_of_tag[self._tag[block_id]] += num_tokens - self._fill[block_id]
        self._fill[block_id] = num_tokens

    def raise_fill(self, block_id: int, num_tokens: int) -> None:
        """Record that at least ``num_tokens`` of the block's slots hold a token (never lowers it)."""
        self._check_id(block_id)
        fill = self._fill[block_id]
        if num_tokens > fill:
            if num_tokens > self.block_size:
                raise ValueError(f"fill must be in [0, {self.block_size}], got {num_tokens}")
            if self._ref_count[block_id] > 0:
                self._referenced_fill += num_tokens - fill
                self._fill_of_tag[self._tag[block_id]] += num_tokens - fill
            self._fill[block_id] = num_tokens

    # ------------------------------------------------------------------ prefix-cache hooks
    def mark_cached(self, block_id: int) -> None:
        """Register an in-use block with the prefix cache."""
        self._check_id(block_id)
        if self._ref_count[block_id] == 0:
            raise ValueError(f"block {block_id} must be in use to be cached")
        if not self._cached[block_id]:
            self._cached[block_id] = True
            self._num_cached += 1

    def uncache(self, block_id: int) -> None:
        """Forget that an in-use block is cached (its cache entry went); its last holder then
        frees it to the free stack like any uncached block."""
        self._check_id(block_id)
        if not self._cached[block_id] or self._ref_count[block_id] == 0:
            raise ValueError(f"block {block_id} is not cached and in use")
        self._cached[block_id] = False
        self._num_cached -= 1

    def release_cached(self, block_id: int) -> None:
        """Evict a cached-idle block: it forgets its prefix and returns to the free stack."""
        self._check_id(block_id)
        if not self._cached[block_id] or self._ref_count[block_id] != 0:
            raise ValueError(f"block {block_id} is not cached-idle and cannot be evicted")
        self._cached[block_id] = False
        self._num_cached -= 1
        self._num_cached_idle -= 1
        self._fill[block_id] = 0
        self._free_stack.append(block_id)

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Assert the counters agree with the per-block state; raises AssertionError."""
        free = set(self._free_stack)
        assert len(free) == len(self._free_stack), "a block is on the free stack twice"
        referenced = sum(1 for rc in self._ref_count if rc > 0)
        cached_idle = sum(1 for b in range(self.num_blocks) if self._cached[b] and self._ref_count[b] == 0)
        assert referenced == self._num_referenced, (referenced, self._num_referenced)
        assert cached_idle == self._num_cached_idle, (cached_idle, self._num_cached_idle)
        assert sum(self._cached) == self._num_cached
        assert len(free) + cached_idle + referenced == self.num_blocks, "blocks leaked or double-counted"
        for b in free:
            assert self._ref_count[b] == 0 and not self._cached[b], f"block {b} free but held"
        fill = sum(self._fill[b] for b in range(self.num_blocks) if self._ref_count[b] > 0)
        assert fill == self._referenced_fill, (fill, self._referenced_fill)
        for tag in range(self.num_tags):
            held = [b for b in range(self.num_blocks) if self._ref_count[b] > 0 and self._tag[b] == tag]
            assert len(held) == self._referenced_of_tag[tag], (tag, len(held), self._referenced_of_tag[tag])
            assert sum(self._fill[b] for b in held) == self._fill_of_tag[tag], f"tag {tag}: fill count drifted"

    def _check_id(self, block_id: int) -> None:
        if type(block_id) is int and 0 <= block_id < self.num_blocks:
            return  # the common case, checked first: this runs on every per-step lookup
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)) or not (
            0 <= block_id < self.num_blocks
        ):
            raise ValueError(f"unknown block {block_id!r} (pool has {self.num_blocks})")
