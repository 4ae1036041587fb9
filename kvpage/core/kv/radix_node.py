"""The radix tree's node, its block hash, and the result of a prefix match (``radix_cache``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvpage.core.block_hash import BlockHash, chain_hashes

BlockKey = tuple  # the block_size token ids of one full block


class RadixNode:
    """One cached full block of group 0 (a root: one namespace, no block).

    ``key`` is the block's token ids, the path from the root the whole prefix before it.
    ``last_access`` is the cache's clock at the last match or insert that touched it (LRU).
    """

    __slots__ = ("key", "block_id", "parent", "children", "last_access", "block_hash", "group_blocks")

    def __init__(self, key: Optional[BlockKey], block_id: Optional[int], parent: Optional["RadixNode"],
                 block_hash: Optional[BlockHash] = None) -> None:
        self.key = key
        self.block_id = block_id  # group 0's block
        self.parent = parent
        self.children: dict[BlockKey, RadixNode] = {}
        self.last_access = 0
        self.block_hash = block_hash  # a root's is its namespace's; a block's is filled in lazily
        # Groups 1.. (hybrid models only): each group's block for these tokens, or None once
        # a sliding group's block was evicted.
        self.group_blocks: Optional[list[Optional[int]]] = None


def node_hash(node: RadixNode, block_size: int) -> BlockHash:
    """The node's block hash: chained from the nearest ancestor that has one (memoized)."""
    if node.block_hash is None:
        path = []
        while node.block_hash is None:
            path.append(node)
            node = node.parent
        parent = node.block_hash
        for n in reversed(path):
            (parent,) = chain_hashes(parent, n.key, block_size)
            n.block_hash = parent
        node = path[0]
    return node.block_hash


def parent_hash(node: RadixNode, block_size: int) -> Optional[BlockHash]:
    """The hash of the block before ``node``'s, or None at the head of a sequence."""
    parent = node.parent
    return None if parent.block_id is None else node_hash(parent, block_size)


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
