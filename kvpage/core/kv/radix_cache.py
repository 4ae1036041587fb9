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
invalidation, so one eviction costs O(log n) rather than a rescan of all leaves.

With several KV groups (a hybrid model: ``kv_groups``) the tree is keyed on group 0 (full
attention): a node exists while its group-0 block is cached, and it also records the
blocks of the other groups for the same tokens (``group_blocks``). Those of another full
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Optional, Sequence

from kvpage.core.block_hash import BlockHash, chain_hashes, external_hash, namespace_root
from kvpage.core.kv.block_pool import BlockPool
from kvpage.core.kv_events import MEDIUM_POOL, KVEventLog
from kvpage.core.kv.kv_groups import groups_of_windows

if TYPE_CHECKING:
    from kvpage.core.offload.kv_offload import KVOffloadManager

BlockKey = tuple  # the block_size token ids of one full block


class _Node:
    __slots__ = ("key", "block_id", "parent", "children", "last_access", "block_hash", "group_blocks")

    def __init__(self, key: Optional[BlockKey], block_id: Optional[int], parent: Optional["_Node"],
                 block_hash: Optional[BlockHash] = None, group_blocks: Optional[list] = None) -> None:
        self.key = key
        self.block_id = block_id  # group 0's block
        self.parent = parent
        self.children: dict[BlockKey, _Node] = {}
        self.last_access = 0
        self.block_hash = block_hash  # a root's is its namespace's; a block's is filled in lazily
        # Groups 1.. (hybrid models only): each group's block for these tokens, or None once
        # a sliding group's block was evicted.
        self.group_blocks = group_blocks


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Cached full blocks covering the first ``num_tokens`` tokens of a query.

    Block regions of the match (``bs`` = block_size)::

        | block_ids (in the pool) | load_hashes (host tier) | fetch / pending (disk) |
        0                                                   num_tokens

    ``num_tokens`` covers the pool blocks and ``load_hashes``: the blocks a step can use
    now. ``fetch_hashes`` (disk-only) and ``pending_hashes`` (being read from disk) follow;
    a request that waits for them can continue the match further (see ``Scheduler``).
    """

    block_ids: tuple[int, ...]
    num_tokens: int
    load_hashes: tuple = ()
    fetch_hashes: tuple = ()
    pending_hashes: tuple = ()
    # Groups 1.. (hybrid models): (first block index, block ids from there to the hit's end).
    group_blocks: tuple = ()

    @property
    def waits_for_disk(self) -> bool:
        return bool(self.fetch_hashes or self.pending_hashes)


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
        self._roots: dict[Hashable, _Node] = {}
        self._node_of_block: dict[int, _Node] = {}
        self._group_of_block: dict[int, tuple] = {}  # a cached block of group g >= 1 -> (node, g)
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, _Node, int]] = []  # (last access, tiebreak, node, group)
        self._tiebreak = itertools.count()
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted_blocks = 0
        pool.set_evictor(self)

    # ------------------------------------------------------------------ queries
    @property
    def num_cached_blocks(self) -> int:
        """Cached pool blocks, of every group."""
        return len(self._node_of_block) + len(self._group_of_block)

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
                found.append((child.last_access, external_hash(self.hash_of(child))))
                stack.append(child)
        if max_blocks is not None and len(found) > max_blocks:
            found = heapq.nlargest(max_blocks, found)
        return [h for _, h in found]

    def _block_keys(self, tokens: Sequence[int], num_blocks: int) -> list[BlockKey]:
        bs = self.block_size
        return [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(num_blocks)]

    def match_prefix(
        self,
        tokens: Sequence[int],
        namespace: Hashable = None,
        max_blocks: Optional[int] = None,
        record: bool = True,
    ) -> PrefixMatch:
        """Longest run of cached full blocks that prefixes ``tokens``.

        Touches the matched nodes for LRU. With ``record`` the query counts toward the
        hit counters (``num_queried_tokens`` += len(tokens), ``num_hit_tokens`` += hit).
        """
        limit = len(tokens) // self.block_size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        node = self._roots.get(namespace)
        path: list[_Node] = []
        if node is not None:
            for key in self._block_keys(tokens, limit):
                child = node.children.get(key)
                if child is None:
                    break
                path.append(child)
                node = child
        hit = self._sliding_hit(path) if len(self.groups) > 1 else len(path)
        now = next(self._clock)
        for child in path[:hit]:
            child.last_access = now
        match = PrefixMatch(tuple(n.block_id for n in path[:hit]), hit * self.block_size,
                            group_blocks=self._group_hit(path, hit))
        if record:
            self.record_query(len(tokens), match.num_tokens)
        return match

    def _sliding_hit(self, path: Sequence[_Node]) -> int:
        """The longest prefix of ``path`` (blocks) whose sliding groups hold the window before
        its end; right to left, as the cache's contract states."""
        sliding = [(g, group) for g, group in enumerate(self.groups) if group.is_sliding]
        # runs[g][i]: consecutive blocks of group g present up to and including path[i].
        runs = {}
        for g, _ in sliding:
            run, count = [], 0
            for node in path:
                count = count + 1 if node.group_blocks[g - 1] is not None else 0
                run.append(count)
            runs[g] = run
        for k in range(len(path), 0, -1):
            if all(runs[g][k - 1] >= k - group.first_needed_block(k * self.block_size, self.block_size)
                   for g, group in sliding):
                return k
        return 0

    def _group_hit(self, path: Sequence[_Node], hit: int) -> tuple:
        """``PrefixMatch.group_blocks`` of a hit of ``hit`` blocks along ``path``."""
        out = []
        for g in range(1, len(self.groups)):
            first = self.groups[g].first_needed_block(hit * self.block_size, self.block_size)
            out.append((first, tuple(n.group_blocks[g - 1] for n in path[first:hit])))
        return tuple(out)

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
        now = next(self._clock)
        foreign = False  # walking nodes whose group-0 blocks are another holder's
        if start_block > 0:
            node = self._node_of_block.get(block_ids[start_block - 1])
            if node is None and group_tables:
                node, foreign = self._walk(tokens, namespace, start_block), True
            if node is None:
                return 0  # an earlier insert stopped before this block; it stops there again
            ancestor = node
            while ancestor.block_id is not None:  # the path is in use again: touch it for LRU
                ancestor.last_access = now
                ancestor = ancestor.parent
        else:
            node = self._roots.get(namespace)
            if node is None:
                node = self._roots[namespace] = _Node(None, None, None, namespace_root(namespace))
        added = 0
        bs = self.block_size
        for index in range(start_block, len(block_ids)):
            key = tuple(tokens[index * bs : (index + 1) * bs])
            block_id = block_ids[index]
            child = node.children.get(key)
            if child is not None and child.block_id != block_id:
                if not group_tables:
                    break
                self._adopt_group_blocks(child, group_tables, index)
                foreign = True
            elif child is None:
                # Hanging our next block under someone else's would let that block go idle
                # (counted as free) while an in-use child pins it: eviction only takes
                # leaves, so the pool would promise blocks it cannot produce.
                if foreign or block_id in self._node_of_block:
                    break  # (or: already cached under another prefix; one block, one identity)
                child = _Node(key, block_id, node)
                if group_tables and not self._attach_group_blocks(child, group_tables, index):
                    break
                node.children[key] = child
                self._node_of_block[block_id] = child
                self.pool.mark_cached(block_id)
                added += 1
            child.last_access = now
            node = child
        if added and self.events.enabled:
            self._log_stored(node, added)  # new nodes have no children: they end the walk
        return added

    def _attach_group_blocks(self, node: _Node, group_tables: Sequence[Sequence[int]], index: int) -> bool:
        """Cache the holder's group blocks at ``index`` with the new ``node``; False (nothing
        cached) if one is cached under another prefix already."""
        blocks = [table[index] for table in group_tables]
        if any(b in self._group_of_block or b in self._node_of_block for b in blocks):
            return False
        node.group_blocks = [None] * len(blocks)
        for g, b in enumerate(blocks, start=1):
            self._cache_group_block(node, g, b)
        return True

    def _walk(self, tokens: Sequence[int], namespace: Hashable, num_blocks: int) -> Optional[_Node]:
        """The node of ``tokens``' first ``num_blocks`` blocks, or None if the path is shorter."""
        node = self._roots.get(namespace)
        for key in self._block_keys(tokens, num_blocks):
            if node is None:
                return None
            node = node.children.get(key)
        return node

    def _adopt_group_blocks(self, node: _Node, group_tables: Sequence[Sequence[int]], index: int) -> None:
        """Cache the caller's sliding-group blocks at ``index`` where ``node`` has none."""
        for g, table in enumerate(group_tables, start=1):
            block_id = table[index]
            if (node.group_blocks[g - 1] is None and self.groups[g].is_sliding
                    and block_id not in self._group_of_block and block_id not in self._node_of_block):
                self._cache_group_block(node, g, block_id)

    def _cache_group_block(self, node: _Node, group: int, block_id: int) -> None:
        node.group_blocks[group - 1] = block_id
        self._group_of_block[block_id] = (node, group)
        self.pool.mark_cached(block_id)

    def _log_stored(self, last: _Node, count: int) -> None:
        """One ``BlockStored`` event for the ``count`` new nodes ending at ``last``."""
        path = []
        while len(path) < count:
            path.append(last)
            last = last.parent
        path.reverse()
        tokens = list(itertools.chain.from_iterable(n.key for n in path))
        self.events.stored([self.hash_of(n) for n in path], self._parent_hash(path[0]), tokens,
                           self.block_size, MEDIUM_POOL)

    # ------------------------------------------------------------------ hashes
    def hash_of(self, node: _Node) -> BlockHash:
        """The node's block hash: chained from the nearest ancestor that has one (memoized)."""
        if node.block_hash is None:
            path = []
            while node.block_hash is None:
                path.append(node)
                node = node.parent
            parent = node.block_hash
            for n in reversed(path):
                (parent,) = chain_hashes(parent, n.key, self.block_size)
                n.block_hash = parent
            node = path[0]
        return node.block_hash

    def _parent_hash(self, node: _Node) -> Optional[BlockHash]:
        parent = node.parent
        return None if parent.block_id is None else self.hash_of(parent)

    def cached_block(self, block_id: int) -> Optional[tuple[BlockHash, Optional[BlockHash], BlockKey]]:
        """(hash, parent hash or None, token ids) of a cached pool block, or None if it is not cached."""
        node = self._node_of_block.get(block_id)
        return None if node is None else (self.hash_of(node), self._parent_hash(node), node.key)

    def cached_hashes(self) -> list[BlockHash]:
        """The hash of every cached pool block (for checks and event reconstruction)."""
        return [self.hash_of(n) for n in self._node_of_block.values()]

    # ------------------------------------------------------------------ eviction
    def on_block_idle(self, block_id: int) -> None:
        node = self._node_of_block.get(block_id)
        if node is not None:
            if not node.children:
                self._push(node)
            return
        node, g = self._group_of_block[block_id]
        if self.groups[g].is_sliding:
            self._push(node, g)  # another full group's block goes with its node

    def _push(self, node: _Node, group: int = 0) -> None:
        """Queue ``node`` for eviction (``group`` 0: the whole node; else one sliding block)."""
        heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node, group))
        # Stale entries are dropped only when popped, and without memory pressure nothing
        # pops: rebuild once they dominate, so the heap stays O(cached blocks), amortized O(1).
        if len(self._heap) > 2 * self.num_cached_blocks + 64:
            self._heap = [(n.last_access, next(self._tiebreak), n, 0)
                          for n in self._node_of_block.values() if self._is_idle_leaf(n)]
            self._heap += [(n.last_access, next(self._tiebreak), n, g)
                           for b, (n, g) in self._group_of_block.items() if self._is_idle_sliding(b, n, g)]
            heapq.heapify(self._heap)

    def _is_idle_leaf(self, node: _Node) -> bool:
        return (
            not node.children
            and self._node_of_block.get(node.block_id) is node
            and self.pool.ref_count(node.block_id) == 0
        )

    def _is_idle_sliding(self, block_id: Optional[int], node: _Node, group: int) -> bool:
        return (block_id is not None and self.groups[group].is_sliding
                and self._group_of_block.get(block_id) == (node, group) and self.pool.ref_count(block_id) == 0)

    def evict(self, num_blocks: int) -> int:
        """Evict least recently used idle leaves (and idle sliding-group blocks anywhere)
        until ``num_blocks`` blocks are released; return how many were (a leaf releases its
        other groups' blocks with it, so it may be more).

        Each victim goes to the offload manager (if any) while its KV is still intact.
        """
        evicted = 0
        gone: list[BlockHash] = []
        while evicted < num_blocks and self._heap:
            stamp, _, node, group = heapq.heappop(self._heap)
            if group:
                block_id = node.group_blocks[group - 1]
                if not self._is_idle_sliding(block_id, node, group):
                    continue  # stale: evicted already, its node went, or locked again
                if stamp != node.last_access:
                    self._push(node, group)
                    continue
                node.group_blocks[group - 1] = None
                del self._group_of_block[block_id]
                self.pool.release_cached(block_id)
                evicted += 1
                continue
            if not self._is_idle_leaf(node):
                continue  # stale: evicted already, gained children, or locked again
            if stamp != node.last_access:
                self._push(node)  # touched since it was queued: requeue at its true age
                continue
            if self.offload is not None or self.events.enabled:
                block_hash = self.hash_of(node)
                gone.append(block_hash)
                if self.offload is not None:
                    self.offload.on_pool_evict(block_hash, node.block_id, node.key, self._parent_hash(node))
            evicted += self._remove(node)
            parent = node.parent
            if parent.block_id is not None and self._is_idle_leaf(parent):
                self._push(parent)
        self.num_evicted_blocks += evicted
        self.events.removed(gone, MEDIUM_POOL)
        return evicted

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
                    self.events.removed([self.hash_of(node)], MEDIUM_POOL)
                self._remove(node)
                removed += 1
                parent = node.parent
                if parent.block_id is not None and self._is_idle_leaf(parent):
                    self._push(parent)
        return removed

    def _remove(self, node: _Node) -> int:
        """Take an idle leaf out of the tree; returns the blocks released (all groups)."""
        del node.parent.children[node.key]
        del self._node_of_block[node.block_id]
        self.pool.release_cached(node.block_id)
        released = 1
        for b in node.group_blocks or ():
            if b is None:
                continue
            del self._group_of_block[b]
            if self.pool.ref_count(b):
                self.pool.uncache(b)  # adopted and still held: its holder frees it as any block
            else:
                self.pool.release_cached(b)
                released += 1
        return released

    def reset(self) -> None:
        """Evict every idle cached block. Raises ``ValueError`` if any cached block is in use."""
        if any(self.pool.ref_count(b) for b in itertools.chain(self._node_of_block, self._group_of_block)):
            raise ValueError("cannot reset the prefix cache while cached blocks are in use")
        if self.events.enabled:
            self.events.removed(self.cached_hashes(), MEDIUM_POOL)
        for block_id in itertools.chain(self._node_of_block, self._group_of_block):
            self.pool.release_cached(block_id)
        self._node_of_block.clear()
        self._group_of_block.clear()
        self._roots.clear()
        self._heap.clear()

    # ------------------------------------------------------------------ checks
    def _check_group_blocks(self, node: _Node, queued: set) -> int:
        """Check one node's blocks of groups 1..; returns how many it holds."""
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
            assert self._group_of_block.get(b) == (node, g) and self.pool.is_cached(b)
            if self.pool.ref_count(b) > 0:
                # Holders take whole prefixes, except a sliding block adopted from another holder.
                assert self.groups[g].is_sliding or self.pool.ref_count(node.block_id) > 0, \
                    f"group {g} block {b} is held, its node's is not"
            elif self.groups[g].is_sliding:
                assert (id(node), g) in queued, f"idle sliding block {b} is not evictable"
        return count

    def check_integrity(self) -> None:
        """Assert tree, pool and heap agree; raises AssertionError."""
        seen = 0
        stack = list(self._roots.values())
        queued = {(id(entry[2]), entry[3]) for entry in self._heap}
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
                seen += 1 + self._check_group_blocks(child, queued)
                stack.append(child)
        assert seen == self.num_cached_blocks == self.pool.num_cached_blocks
        self.pool.check_integrity()
