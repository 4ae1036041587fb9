"""The prefix-cache side of ``KVCacheManager``: find a hit, lock it, load it, offer new blocks.

Token regions of a request admitted with a hit (``bs`` = block_size)::

    |<- pool blocks (locked) ->|<- host blocks (loaded) ->|<- computed by the step ->|
    0              len(block_ids) * bs             hit.num_tokens                 num_tokens

The host blocks get fresh pool blocks, filled by the step's ``kv_transfers`` before its
forward. Both kinds of hit block are full, so they count as computed (and cached) tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from kvpage.core.kv.block_pool import BlockPool
from kvpage.core.kv.radix_cache import RadixCache
from kvpage.core.kv.radix_node import PrefixMatch
from kvpage.core.request import Request

if TYPE_CHECKING:
    from kvpage.core.offload.kv_offload import KVOffloadManager
    from kvpage.core.offload.kv_transfers import DiskOp

NO_HIT = PrefixMatch((), 0)


class PrefixHits:
    """Prefix hits over an optional ``RadixCache`` (and the lower tiers of an optional
    ``KVOffloadManager`` under it); without a cache there is never a hit."""

    def __init__(self, pool: BlockPool, prefix_cache: Optional[RadixCache],
                 offload: Optional["KVOffloadManager"]) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.offload = offload
        self.block_size = pool.block_size

    def match(self, request: Request) -> PrefixMatch:
        """Cached blocks the request may reuse; at least one token is always left to compute."""
        if self.prefix_cache is None:
            return NO_HIT
        # The last token must run through the model to produce logits, so a prompt whose
        # every block is cached gives back its last block.
        max_blocks = (request.num_tokens - 1) // self.block_size
        pool = self.prefix_cache.match_prefix(
            request.all_token_ids, request.namespace, max_blocks=max_blocks, record=False
        )
        if self.offload is None or len(pool.block_ids) >= max_blocks:
            return pool
        # Past the tree the chain continues in the lower tiers, looked up by block hash.
        hashes = request.full_block_hashes(max_blocks, self.block_size)[len(pool.block_ids):]
        lower = self.offload.lookup(hashes)
        return PrefixMatch(pool.block_ids, pool.num_tokens + len(lower.ready) * self.block_size,
                           lower.ready, lower.fetch, lower.pending)

    @staticmethod
    def blocks_to_lock(hit: PrefixMatch) -> list[int]:
        """The hit's pool blocks, of every group."""
        return [*hit.block_ids, *(b for _, blocks in hit.group_blocks for b in blocks)]

    def lock(self, request: Request, hit: PrefixMatch, locked: Sequence[int]) -> None:
        """Lock the hit's blocks (``blocks_to_lock``) and pin its host entries, then move the
        blockless ``request``'s computed tokens to the end of the hit. The caller checked
        that the pool can also supply the step's fresh blocks."""
        if hit.load_hashes:
            self.offload.pin_for_load(hit.load_hashes)  # before an allocation's evictions reach the host tier
        self.pool.incref(locked)  # lock before any allocation can evict them
        request.block_ids.extend(hit.block_ids)
        for g, (first, blocks) in enumerate(hit.group_blocks, start=1):
            # A sliding group's hit starts at its window: the blocks before it are padding.
            request.block_tables[g] = [0] * first + list(blocks)
            request.released_blocks[g] = first
        request.num_computed_tokens = request.num_cached_tokens = hit.num_tokens
        request.num_inserted_blocks = len(hit.block_ids)

    def plan_host_loads(self, request: Request, hit: PrefixMatch) -> int:
        """Schedule the hit's host blocks into the pool blocks allocated after its pool
        blocks; returns the first token position they cover."""
        first = len(hit.block_ids)
        self.offload.plan_loads(hit.load_hashes, request.block_ids[first : first + len(hit.load_hashes)])
        return first * self.block_size

    def offer(self, request: Request, num_new_tokens: int) -> list[int]:
        """Offer the blocks this step fills to the prefix cache; return those newly cached
        (see ``KVCacheManager.cache_scheduled_blocks``)."""
        if self.prefix_cache is None:
            return []
        num_full = min((request.num_computed_tokens + num_new_tokens) // self.block_size, len(request.block_ids))
        start = request.num_inserted_blocks
        if num_full <= start:
            return []
        # Resume after the blocks already offered: re-walking the whole prefix every time a
        # block fills would cost O(context) per decode block.
        added = self.prefix_cache.insert(
            request.all_token_ids, request.block_ids[:num_full], request.namespace, start_block=start,
            group_tables=request.block_tables[1:],
        )
        request.num_inserted_blocks = num_full
        return request.block_ids[start : start + added]

    def plan_disk_saves(self, block_ids: Sequence[int]) -> list["DiskOp"]:
        """Disk ops saving those of ``block_ids`` (head first) that are still cached and not
        on disk yet (``KVOffloadManager.plan_saves``)."""
        blocks = []
        for block_id in block_ids:
            cached = self.prefix_cache.cached_block(block_id)
            if cached is not None:
                block_hash, parent, token_ids = cached
                blocks.append((block_hash, block_id, parent, token_ids))
        return self.offload.plan_saves(blocks)
