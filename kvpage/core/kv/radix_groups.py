"""The cached blocks of KV groups 1.. (hybrid models), kept with the tree's group-0 nodes.

A node's ``group_blocks[g - 1]`` is group ``g``'s block for the node's tokens. That of a
full group lives and dies with the node; that of a sliding group may be evicted on its own
(its holders released it once it fell behind their window), leaving a hole (``None``).

A hit of ``k`` path blocks needs every sliding group of window ``W`` to hold the blocks the
next query reads, ``[first_needed_block(k * bs), k)``::

    path:     | node 0 | node 1 | ... | node k-1 |
    group g:  | (padding, may be holes)  | held, no holes |
              0            first_needed_block(k * bs)     k
"""
from __future__ import annotations

from typing import Container, Iterator, Optional, Sequence

from kvpage.core.kv.block_pool import BlockPool
from kvpage.core.kv.kv_groups import KVGroup
from kvpage.core.kv.radix_node import RadixNode


class GroupBlocks:
    """Which node (and group) each cached block of groups 1.. belongs to."""

    def __init__(self, pool: BlockPool, groups: Sequence[KVGroup]) -> None:
        self.pool = pool
        self.groups = tuple(groups)
        self.block_size = pool.block_size
        self.sliding = tuple((g, group) for g, group in enumerate(self.groups) if group.is_sliding)
        self._owner: dict[int, tuple[RadixNode, int]] = {}  # block -> (node, group >= 1)

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._owner

    def __iter__(self) -> Iterator[int]:
        return iter(self._owner)

    def owner(self, block_id: int) -> tuple[RadixNode, int]:
        """(node, group) of a cached group block; raises ``KeyError`` if it is not one."""
        return self._owner[block_id]

    # ------------------------------------------------------------------ hits
    def hit_length(self, path: Sequence[RadixNode]) -> int:
        """The longest prefix of ``path`` (blocks) whose sliding groups hold the window before
        its end; found right to left."""
        # runs[g][i]: consecutive blocks of group g present up to and including path[i].
        runs = {}
        for g, _ in self.sliding:
            run, count = [], 0
            for node in path:
                count = count + 1 if node.group_blocks[g - 1] is not None else 0
                run.append(count)
            runs[g] = run
        bs = self.block_size
        for k in range(len(path), 0, -1):
            if all(runs[g][k - 1] >= k - group.first_needed_block(k * bs, bs) for g, group in self.sliding):
                return k
        return 0

    def hit_blocks(self, path: Sequence[RadixNode], hit: int) -> tuple:
        """``PrefixMatch.group_blocks`` of a hit of ``hit`` blocks along ``path``."""
        out = []
        for g in range(1, len(self.groups)):
            first = self.groups[g].first_needed_block(hit * self.block_size, self.block_size)
            out.append((first, tuple(n.group_blocks[g - 1] for n in path[first:hit])))
        return tuple(out)

    # ------------------------------------------------------------------ insertion
    def attach(self, node: RadixNode, group_tables: Sequence[Sequence[int]], index: int,
               node_blocks: Container[int]) -> bool:
        """Cache the holder's blocks at ``index`` of ``group_tables`` with the new ``node``;
        False (nothing cached) if one is cached already (here or as a node's: ``node_blocks``)."""
        blocks = [table[index] for table in group_tables]
        if any(b in self._owner or b in node_blocks for b in blocks):
            return False
        node.group_blocks = [None] * len(blocks)
        for g, b in enumerate(blocks, start=1):
            self._cache(node, g, b)
        return True

    def adopt(self, node: RadixNode, group_tables: Sequence[Sequence[int]], index: int,
              node_blocks: Container[int]) -> None:
        """Fill the sliding-group holes of another holder's ``node`` with the caller's blocks at
        ``index`` (see ``RadixCache.insert``)."""
        for g, table in enumerate(group_tables, start=1):
            block_id = table[index]
            if (node.group_blocks[g - 1] is None and self.groups[g].is_sliding
                    and block_id not in self._owner and block_id not in node_blocks):
                self._cache(node, g, block_id)

    def _cache(self, node: RadixNode, group: int, block_id: int) -> None:
        node.group_blocks[group - 1] = block_id
        self._owner[block_id] = (node, group)
        self.pool.mark_cached(block_id)

    # ------------------------------------------------------------------ eviction
    def is_idle_sliding(self, block_id: Optional[int], node: RadixNode, group: int) -> bool:
        """True if ``block_id`` is ``node``'s cached, unreferenced block of sliding ``group``."""
        return (block_id is not None and self.groups[group].is_sliding
                and self._owner.get(block_id) == (node, group) and self.pool.ref_count(block_id) == 0)

    def idle_sliding(self) -> Iterator[tuple[RadixNode, int]]:
        """(node, group) of every sliding block that could be evicted now."""
        return ((n, g) for b, (n, g) in self._owner.items() if self.is_idle_sliding(b, n, g))

    def evict(self, node: RadixNode, group: int) -> None:
        """Release ``node``'s idle block of sliding ``group``, leaving a hole."""
        block_id = node.group_blocks[group - 1]
        node.group_blocks[group - 1] = None
        del self._owner[block_id]
        self.pool.release_cached(block_id)

    def release_with(self, node: RadixNode) -> int:
        """Forget the blocks of ``node``, which leaves the tree; returns how many went back
        to the pool (one adopted and still held is its holder's to free, as any block)."""
        released = 0
        for b in node.group_blocks or ():
            if b is None:
                continue
            del self._owner[b]
            if self.pool.ref_count(b):
                self.pool.uncache(b)
            else:
                self.pool.release_cached(b)
                released += 1
        return released

    def release_all(self) -> None:
        """Release every block (all idle: the caller checked) and forget them."""
        for block_id in self._owner:
            self.pool.release_cached(block_id)
        self._owner.clear()

    # ------------------------------------------------------------------ checks
    def check(self, node: RadixNode, queued: Container[tuple[int, int]]) -> int:
        """Assert one node's blocks of groups 1.. agree with the pool and the eviction heap's
        ``queued`` ``(id(node), group)`` entries; returns how many it holds."""
        if len(self.groups) == 1:
            assert node.group_blocks is None
            return 0
        assert node.group_blocks is not None and len(node.group_blocks) == len(self.groups) - 1
        count = 0
        for g, b in enumerate(node.group_blocks, start=1):
            if b is None:
                assert self.groups[g].is_sliding, f"full group {g} lost its block under a live node"
                continue
            count += 1
            assert self._owner.get(b) == (node, g) and self.pool.is_cached(b)
            if self.pool.ref_count(b) > 0:
                # Holders take whole prefixes, except a sliding block adopted from another holder.
                assert self.groups[g].is_sliding or self.pool.ref_count(node.block_id) > 0, \
                    f"group {g} block {b} is held, its node's is not"
            elif self.groups[g].is_sliding:
                assert (id(node), g) in queued, f"idle sliding block {b} is not evictable"
        return count

