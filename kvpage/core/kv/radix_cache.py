"""A radix tree of cached KV blocks, keyed by the token ids each block holds.

Each node stands for one *full* block: its key is the tuple of ``block_size`` token
ids in that block, its path from the root is the whole prefix before it. Nodes under
different namespaces (a cache salt, an adapter id) never meet: each namespace has its
own root.

Contract with users of ``match_prefix``:
  * the returned blocks must be locked (``BlockPool.incref``) before the pool is asked
    for any other block, since an allocation may evict idle cached blocks;
  * a locked block (ref_count > 0) is never evicted;
  * ``insert`` only takes blocks whose KV has been fully written.

Eviction is LRU over idle leaves: a min-heap of (last access, node) with lazy
invalidation (``eviction_heap``), so one eviction costs O(log n) rather than a rescan of
all leaves.

With several KV groups (a hybrid model: ``kv_groups``) the tree is keyed on group 0 (full
attention): a node exists while its group-0 block is cached, and it also records the
blocks of the other groups for the same tokens (``radix_groups``). Those of another full
group live and die with the node. Those of a sliding group are evicted on their own (their
holders released them once they fell behind the window), which leaves holes. A hit of
``k`` blocks therefore needs (vLLM's rule): every full group holds blocks ``[0, k)`` (the
path does, by construction), and every sliding group of window ``W`` holds the blocks its
next query reads, ``[first_needed_block(k * bs), k)``; the longest path prefix meeting both
is the hit, found right to left. The blocks a sliding group's hit leaves out are padding.

The tree holds the pool tier only. Each node knows its block hash (``block_hash``, computed
on first use from its parent's), the key under which the lower tiers keep its KV once it is
evicted: with an offload manager, ``evict`` hands every victim to it
(``KVOffloadManager.on_pool_evict``) before the block is reused. With an event log, every
block entering or leaving the tree is an event (medium ``"GPU"``).
"""
from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Hashable, Optional, Sequence

from kvpage.core.block_hash import BlockHash, external_hash, namespace_root
from kvpage.core.kv.block_pool import BlockPool
from kvpage.core.kv.eviction_heap import EvictionHeap
from kvpage.core.kv.kv_groups import groups_of_windows
from kvpage.core.kv.radix_groups import GroupBlocks
from kvpage.core.kv.radix_node import BlockKey, PrefixMatch, RadixNode, node_hash, parent_hash
from kvpage.core.kv_events import MEDIUM_POOL, KVEventLog

if TYPE_CHECKING:
    from kvpage.core.offload.kv_offload import KVOffloadManager


class RadixCache:
    """Block-granular prefix cache over a ``BlockPool`` (it becomes the pool's evictor)."""

    def __init__(self, pool: BlockPool, offload: Optional["KVOffloadManager"] = None,
                 events: Optional[KVEventLog] = None, windows: Sequence[Optional[int]] = (None,)) -> None:
        """``windows``: each KV group's sliding window (``None``: full); group 0 must be full."""
        self.pool = pool
        self.offload = offload
        self.events = events or KVEventLog()
        self.block_size = pool.block_size
        self.groups = groups_of_windows(windows)
        self._roots: dict[Hashable, RadixNode] = {}
        self._node_of_block: dict[int, RadixNode] = {}
        self._group_blocks = GroupBlocks(pool, self.groups)  # blocks of groups 1..
        self._clock = itertools.count(1)
        self._heap = EvictionHeap()
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted_blocks = 0
        pool.set_evictor(self)

    # ------------------------------------------------------------------ queries
    @property
    def num_cached_blocks(self) -> int:
        """Cached pool blocks, of every group."""
        return len(self._node_of_block) + len(self._group_blocks)

    @property
    def hit_rate(self) -> float:
        return 0.0 if self.num_queried_tokens == 0 else self.num_hit_tokens / self.num_queried_tokens

    def block_hashes(self, namespace: Hashable = None, max_blocks: Optional[int] = None) -> list[int]:
        """The 64-bit block hashes (``block_hash.external_hash``, as in the KV events) of every
        cached block of ``namespace``.

        A compact, picklable summary of what this cache holds, for a router in another
        process: it computes the same chain for a prompt (``block_hash.chain_hashes`` from
        ``namespace_root``). With ``max_blocks`` only the most recently used blocks are
        listed; since a match touches the whole path, a listed block's ancestors are as
        recent or more, so the summary still answers prefix queries. O(cached blocks).
        """
        root = self._roots.get(namespace)
        if root is None:
            return []
        found: list[tuple[int, int]] = []  # (last access, hash)
        stack = [root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                found.append((child.last_access, external_hash(node_hash(child, self.block_size))))
                stack.append(child)
        if max_blocks is not None and len(found) > max_blocks:
            found = heapq.nlargest(max_blocks, found)
        return [h for _, h in found]

    def _block_keys(self, tokens: Sequence[int], num_blocks: int) -> list[BlockKey]:
        bs = self.block_size
        return [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(num_blocks)]

    def match_prefix(self, tokens: Sequence[int], namespace: Hashable = None, max_blocks: Optional[int] = None,
                     record: bool = True) -> PrefixMatch:
        """Longest run of cached full blocks that prefixes ``tokens``.

        Touches the matched nodes for LRU. With ``record`` the query counts toward the
        hit counters (``num_queried_tokens`` += len(tokens), ``num_hit_tokens`` += hit).
        """
        limit = len(tokens) // self.block_size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        node = self._roots.get(namespace)
        path: list[RadixNode] = []
        if node is not None:
            for key in self._block_keys(tokens, limit):
                child = node.children.get(key)
                if child is None:
                    break
                path.append(child)
                node = child
        hit = self._group_blocks.hit_length(path) if len(self.groups) > 1 else len(path)
        now = next(self._clock)
        for child in path[:hit]:
            child.last_access = now
        match = PrefixMatch(tuple(n.block_id for n in path[:hit]), hit * self.block_size,
                            group_blocks=self._group_blocks.hit_blocks(path, hit))
        if record:
            self.record_query(len(tokens), match.num_tokens)
        return match

    def record_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens

    # ------------------------------------------------------------------ insertion
    def insert(
        self, tokens: Sequence[int], block_ids: Sequence[int], namespace: Hashable = None, start_block: int = 0,
        group_tables: Sequence[Sequence[int]] = (),
    ) -> int:
        """Cache the full blocks ``block_ids`` holding ``tokens[: len(block_ids) * block_size]``.

        The blocks must be in use (locked) by the caller. Where a node already holds a
        different block for the same tokens (two requests computed the same prefix at once),
        the existing block is kept and insertion stops there: the caller's duplicate and
        every block after it stay uncached. Returns the number of blocks newly cached.

        ``group_tables`` (hybrid models) are the holder's block tables of groups 1..; their
        entries at the new nodes' positions are cached with them. Along another holder's
        nodes the walk goes on instead of stopping, and fills in the sliding-group blocks
        those nodes lost to eviction with the caller's (*adoption*): otherwise a prefix
        whose window was evicted while its full blocks stayed in use could never be hit
        again, since every request recomputing it would stop at the same nodes.

        ``start_block`` resumes an earlier insert of the same sequence by the same holder:
        ``block_ids[:start_block]`` were offered already, so the walk starts under
        ``block_ids[start_block - 1]`` (nothing is added if that block did not get cached;
        a hybrid holder walking another's path resumes from the root).
        """
        if len(tokens) < len(block_ids) * self.block_size:
            raise ValueError(f"{len(block_ids)} full blocks need {len(block_ids) * self.block_size} tokens, got {len(tokens)}")
        for block_id in block_ids[start_block:]:  # all checked first: a refused insert caches nothing
            if self.pool.ref_count(block_id) == 0:
                raise ValueError(f"block {block_id} must be in use to be cached")
        now = next(self._clock)
        resumed = self._resume_point(tokens, block_ids, namespace, start_block, bool(group_tables), now)
        if resumed is None:
            return 0  # an earlier insert stopped before this block; it stops there again
        node, foreign = resumed  # foreign: walking nodes whose group-0 blocks are another holder's
        added = 0
        bs = self.block_size
        for index in range(start_block, len(block_ids)):
            key = tuple(tokens[index * bs : (index + 1) * bs])
            child = node.children.get(key)
            if child is None:
                child = self._add_node(node, key, block_ids[index], group_tables, index, foreign)
                if child is None:
                    break
                added += 1
            elif child.block_id != block_ids[index]:
                if not group_tables:
                    break
                self._group_blocks.adopt(child, group_tables, index, self._node_of_block)
                foreign = True
            child.last_access = now
            node = child
        if added and self.events.enabled:
            self._log_stored(node, added)  # new nodes have no children: they end the walk
        return added

    def _resume_point(self, tokens: Sequence[int], block_ids: Sequence[int], namespace: Hashable,
                      start_block: int, hybrid: bool, now: int) -> Optional[tuple[RadixNode, bool]]:
        """Where ``insert`` walks on from: the node of block ``start_block - 1`` (touched for
        LRU with its ancestors, since the path is in use again) or the namespace's root, and
        whether that node is another holder's. None: the earlier insert stopped before it."""
        if start_block == 0:
            root = self._roots.get(namespace)
            if root is None:
                root = self._roots[namespace] = RadixNode(None, None, None, namespace_root(namespace))
            return root, False
        node = self._node_of_block.get(block_ids[start_block - 1])
        foreign = False
        if node is None and hybrid:
            node, foreign = self._walk(tokens, namespace, start_block), True
        if node is None:
            return None
        ancestor = node
        while ancestor.block_id is not None:
            ancestor.last_access = now
            ancestor = ancestor.parent
        return node, foreign

    def _add_node(self, parent: RadixNode, key: BlockKey, block_id: int, group_tables: Sequence[Sequence[int]],
                  index: int, foreign: bool) -> Optional[RadixNode]:
        """Cache ``block_id`` (and its groups' blocks at ``index``) as a new child of ``parent``;
        None, caching nothing, if a block of it is cached already (one block, one identity)
        or ``parent`` is another holder's (``foreign``).

        Hanging our block under someone else's would let theirs go idle (counted as free)
        while our in-use child pins it: eviction only takes leaves, so the pool would
        promise blocks it cannot produce.
        """
        if foreign or block_id in self._node_of_block:
            return None
        child = RadixNode(key, block_id, parent)
        if group_tables and not self._group_blocks.attach(child, group_tables, index, self._node_of_block):
            return None
        parent.children[key] = child
        self._node_of_block[block_id] = child
        self.pool.mark_cached(block_id)
        return child

    def _walk(self, tokens: Sequence[int], namespace: Hashable, num_blocks: int) -> Optional[RadixNode]:
        """The node of ``tokens``' first ``num_blocks`` blocks, or None if the path is shorter."""
        node = self._roots.get(namespace)
        for key in self._block_keys(tokens, num_blocks):
            if node is None:
                return None
            node = node.children.get(key)
        return node

    def _log_stored(self, last: RadixNode, count: int) -> None:
        """One ``BlockStored`` event for the ``count`` new nodes ending at ``last``."""
        path = []
        while len(path) < count:
            path.append(last)
            last = last.parent
        path.reverse()
        bs = self.block_size
        tokens = list(itertools.chain.from_iterable(n.key for n in path))
        self.events.stored([node_hash(n, bs) for n in path], parent_hash(path[0], bs), tokens, bs, MEDIUM_POOL)

    # ------------------------------------------------------------------ hashes
    def cached_block(self, block_id: int) -> Optional[tuple[BlockHash, Optional[BlockHash], BlockKey]]:
        """(hash, parent hash or None, token ids) of a cached pool block, or None if it is not cached."""
        node = self._node_of_block.get(block_id)
        if node is None:
            return None
        return node_hash(node, self.block_size), parent_hash(node, self.block_size), node.key

    def cached_hashes(self) -> list[BlockHash]:
        """The hash of every cached pool block (for checks and event reconstruction)."""
        return [node_hash(n, self.block_size) for n in self._node_of_block.values()]

    # ------------------------------------------------------------------ eviction
    def on_block_idle(self, block_id: int) -> None:
        node = self._node_of_block.get(block_id)
        if node is not None:
            if not node.children:
                self._push(node)
            return
        node, g = self._group_blocks.owner(block_id)
        if self.groups[g].is_sliding:
            self._push(node, g)  # another full group's block goes with its node

    def _push(self, node: RadixNode, group: int = 0) -> None:
        """Queue ``node`` for eviction (``group`` 0: the whole node; else one sliding block)."""
        self._heap.push(node, group)
        # Stale entries are dropped only when popped, and without memory pressure nothing
        # pops: rebuild once they dominate, so the heap stays O(cached blocks), amortized O(1).
        if len(self._heap) > 2 * self.num_cached_blocks + 64:
            leaves = ((n, 0) for n in self._node_of_block.values() if self._is_idle_leaf(n))
            self._heap.rebuild(itertools.chain(leaves, self._group_blocks.idle_sliding()))

    def _is_idle_leaf(self, node: RadixNode) -> bool:
        return (
            not node.children
            and self._node_of_block.get(node.block_id) is node
            and self.pool.ref_count(node.block_id) == 0
        )

    def evict(self, num_blocks: int) -> int:
        """Evict least recently used idle leaves (and idle sliding-group blocks anywhere)
        until ``num_blocks`` blocks are released; return how many were (a leaf releases its
        other groups' blocks with it, so it may be more).

        Each victim goes to the offload manager (if any) while its KV is still intact.
        """
        evicted = 0
        gone: list[BlockHash] = []
        while evicted < num_blocks and self._heap:
            stamp, node, group = self._heap.pop()
            idle = (self._group_blocks.is_idle_sliding(node.group_blocks[group - 1], node, group) if group
                    else self._is_idle_leaf(node))
            if not idle:
                continue  # stale: evicted already, its node went, gained children, or locked again
            if stamp != node.last_access:
                self._push(node, group)  # touched since it was queued: requeue at its true age
                continue
            if group:
                self._group_blocks.evict(node, group)
                evicted += 1
            else:
                evicted += self._evict_leaf(node, gone)
        self.num_evicted_blocks += evicted
        self.events.removed(gone, MEDIUM_POOL)
        return evicted

    def _evict_leaf(self, node: RadixNode, gone: list[BlockHash]) -> int:
        """Hand the idle leaf to the lower tiers (its hash to ``gone``) and take it out of the
        tree; returns the blocks released."""
        if self.offload is not None or self.events.enabled:
            block_hash = node_hash(node, self.block_size)
            gone.append(block_hash)
            if self.offload is not None:
                self.offload.on_pool_evict(block_hash, node.block_id, node.key, parent_hash(node, self.block_size))
        return self._remove(node)

    def discard(self, block_ids: Sequence[int]) -> int:
        """Forget cached blocks whose KV turned out invalid (a failed step); return how many
        nodes went (each with its other groups' blocks).

        Only idle leaves can go: pass a sequence's group-0 blocks tail first. Blocks that are
        not cached, still held, or still have children are skipped.
        """
        removed = 0
        for block_id in block_ids:
            node = self._node_of_block.get(block_id)
            if node is not None and self._is_idle_leaf(node):
                if self.events.enabled:
                    self.events.removed([node_hash(node, self.block_size)], MEDIUM_POOL)
                self._remove(node)
                removed += 1
        return removed

    def _remove(self, node: RadixNode) -> int:
        """Take an idle leaf out of the tree, queueing its parent if that became an idle
        leaf; returns the blocks released (all groups)."""
        parent = node.parent
        del parent.children[node.key]
        del self._node_of_block[node.block_id]
        self.pool.release_cached(node.block_id)
        released = 1 + self._group_blocks.release_with(node)
        if parent.block_id is not None and self._is_idle_leaf(parent):
            self._push(parent)
        return released

    def reset(self) -> None:
        """Evict every idle cached block. Raises ``ValueError`` if any cached block is in use."""
        if any(self.pool.ref_count(b) for b in itertools.chain(self._node_of_block, self._group_blocks)):
            raise ValueError("cannot reset the prefix cache while cached blocks are in use")
        if self.events.enabled:
            self.events.removed(self.cached_hashes(), MEDIUM_POOL)
        for block_id in self._node_of_block:
            self.pool.release_cached(block_id)
        self._group_blocks.release_all()
        self._node_of_block.clear()
        self._roots.clear()
        self._heap.clear()

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Assert tree, pool and heap agree; raises AssertionError."""
        seen = 0
        stack = list(self._roots.values())
        queued = set(self._heap.queued())
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node and child.key == key
                assert len(key) == self.block_size
                assert self._node_of_block.get(child.block_id) is child
                assert self.pool.is_cached(child.block_id)
                if node.block_id is not None and self.pool.ref_count(child.block_id) > 0:
                    # Holders take whole prefixes, so an idle block never has an in-use child
                    # (which would make it counted as free yet unevictable).
                    assert self.pool.ref_count(node.block_id) > 0, f"idle block {node.block_id} has an in-use child"
                if not child.children and self.pool.ref_count(child.block_id) == 0:
                    assert (id(child), 0) in queued, f"idle leaf block {child.block_id} is not evictable"
                seen += 1 + self._group_blocks.check(child, queued)
                stack.append(child)
        assert seen == self.num_cached_blocks == self.pool.num_cached_blocks
        self.pool.check_integrity()
