"""Per-request block tables: which blocks a request holds, and when it needs more.

Block regions of one request, in tokens (``bs`` = block_size)::

    |<- cached (prefix hit) ->|<- computed ->|<- new this step ->|<- free slots ->|
    0                  num_cached    num_computed        num_computed + n    len(block_ids) * bs

Blocks are appended as tokens need slots; full blocks never change again, so only the
block receiving new tokens can be shared *and* written, which is where copy-on-write
applies.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from .block_pool import BlockPool
from .radix_cache import PrefixMatch, RadixCache
from .request import Request

if TYPE_CHECKING:
    from .kv_offload import KVOffloadManager

_NO_HIT = PrefixMatch((), 0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the mapping request -> blocks over one ``BlockPool`` and optional ``RadixCache``
    (with an optional ``KVOffloadManager`` for the lower tiers under it)."""

    def __init__(self, pool: BlockPool, prefix_cache: Optional[RadixCache] = None,
                 offload: Optional["KVOffloadManager"] = None) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.offload = offload
        self.block_size = pool.block_size
        self.num_pool_hit_tokens = 0  # tokens served by pool blocks, over every admission

    # ------------------------------------------------------------------ admission
    def match_prefix(self, request: Request) -> PrefixMatch:
        """Cached blocks the request may reuse; at least one token is always left to compute.

        Does not lock the blocks: pass the match to ``allocate_slots`` in the same step.
        """
        if self.prefix_cache is None:
            return _NO_HIT
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

    def num_blocks_needed(self, request: Request, num_new_tokens: int, hit: Optional[PrefixMatch] = None) -> int:
        """Fresh blocks ``allocate_slots`` would take (including a copy-on-write copy)."""
        held = max(len(request.block_ids), len(hit.block_ids) if hit else 0)
        computed = max(request.num_computed_tokens, hit.num_tokens if hit else 0)
        needed = cdiv(computed + num_new_tokens, self.block_size) - held
        return max(needed, 0) + int(self._needs_copy(request, num_new_tokens))

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: Optional[PrefixMatch] = None) -> bool:
        """Reserve KV slots for ``num_new_tokens`` more tokens of ``request``.

        With ``hit`` (only for a request holding no blocks) the cached blocks are locked
        first and the request's computed tokens jump to the end of the hit; the hit's host
        blocks get fresh pool blocks, loaded before the step's forward (and cached with the
        step's other full blocks by ``cache_scheduled_blocks``).
        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        if num_new_tokens == 1 and hit is None:
            # Fast path for most decodes: the token lands inside a private, partly filled block.
            index, offset = divmod(request.num_computed_tokens, self.block_size)
            if offset:
                block = request.block_ids[index]
                if self.pool.ref_count(block) == 1:
                    self.pool.raise_fill(block, offset + 1)
                    return True
        if hit is not None and hit.num_tokens:
            if request.block_ids:
                raise ValueError(
                    f"request {request.request_id!r} already holds blocks; a prefix hit applies only at admission"
                )
            if not self._take_hit(request, num_new_tokens, hit):
                return False
        start = request.num_computed_tokens
        end = start + num_new_tokens
        missing = cdiv(end, self.block_size) - len(request.block_ids)
        copy = self._needs_copy(request, num_new_tokens)
        if missing > 0 or copy:
            if max(missing, 0) + copy > self.pool.num_free_blocks:
                return False
            if copy:
                self._copy_on_write(request)
            if missing > 0:
                request.block_ids.extend(self.pool.allocate(missing))
        if hit is not None and hit.load_hashes:
            first = len(hit.block_ids)
            self.offload.plan_loads(hit.load_hashes, request.block_ids[first : first + len(hit.load_hashes)])
            start = first * self.block_size  # the loaded blocks are full too
        self._update_fill(request, start, end)
        return True

    def _take_hit(self, request: Request, num_new_tokens: int, hit: PrefixMatch) -> bool:
        """Lock the hit's pool blocks and its host entries, or change nothing and return False."""
        # Locking an idle cached block takes it out of the free count just like a fresh one.
        idle_hits = sum(1 for b in hit.block_ids if self.pool.ref_count(b) == 0)
        if self.num_blocks_needed(request, num_new_tokens, hit) + idle_hits > self.pool.num_free_blocks:
            return False
        if hit.load_hashes:
            self.offload.pin_for_load(hit.load_hashes)  # before an allocation's evictions reach the host tier
        self.pool.incref(hit.block_ids)  # lock before any allocation can evict them
        request.block_ids.extend(hit.block_ids)
        request.num_computed_tokens = request.num_cached_tokens = hit.num_tokens
        request.num_inserted_blocks = len(hit.block_ids)
        self.num_pool_hit_tokens += len(hit.block_ids) * self.block_size
        return True

    def _needs_copy(self, request: Request, num_new_tokens: int) -> bool:
        """True when the new tokens land in a partially filled block someone else also holds."""
        offset = request.num_computed_tokens % self.block_size
        if num_new_tokens <= 0 or offset == 0 or not request.block_ids:
            return False
        target = request.block_ids[request.num_computed_tokens // self.block_size]
        return self.pool.ref_count(target) > 1

    def _copy_on_write(self, request: Request) -> None:
        index = request.num_computed_tokens // self.block_size
        shared = request.block_ids[index]
        (private,) = self.pool.allocate(1)
        self.pool.set_fill(private, self.pool.fill(shared))
        self.pool.free([shared])
        request.block_ids[index] = private
        request.pending_block_copies.append((shared, private))

    def _update_fill(self, request: Request, start: int, end: int) -> None:
        bs = self.block_size
        blocks = request.block_ids
        for index in range(start // bs, cdiv(end, bs)):
            self.pool.raise_fill(blocks[index], min(end - index * bs, bs))

    @staticmethod
    def take_pending_copies(requests: Sequence[Request]) -> list[tuple[int, int]]:
        """(src, dst) block copies the runner must perform before the KV writes of a step
        that runs ``requests``; each copy is handed out once."""
        copies: list[tuple[int, int]] = []
        for request in requests:
            if request.pending_block_copies:
                copies += request.pending_block_copies
                request.pending_block_copies = []
        return copies

    # ------------------------------------------------------------------ prefix caching
    def cache_scheduled_blocks(self, request: Request, num_new_tokens: int) -> list[int]:
        """Offer the blocks this step fills to the prefix cache; return those newly cached.

        Called at scheduling time, before the forward runs: every layer writes the whole
        step's K/V before it attends, so a request admitted later in the same step may
        already read these blocks. If the step fails, pass the returned blocks to
        ``RadixCache.discard`` once their holders are gone.
        """
        if self.prefix_cache is None:
            return []
        num_full = min((request.num_computed_tokens + num_new_tokens) // self.block_size, len(request.block_ids))
        start = request.num_inserted_blocks
        if num_full <= start:
            return []
        # Resume after the blocks already offered: re-walking the whole prefix every time a
        # block fills would cost O(context) per decode block.
        added = self.prefix_cache.insert(
            request.all_token_ids, request.block_ids[:num_full], request.namespace, start_block=start
        )
        request.num_inserted_blocks = num_full
        return request.block_ids[start : start + added]

    def plan_disk_saves(self, block_ids: Sequence[int]) -> list:
        """Disk ops saving those of ``block_ids`` (head first) that are still cached and not
        on disk yet (``KVOffloadManager.plan_saves``); call after their step succeeded."""
        blocks = []
        for block_id in block_ids:
            cached = self.prefix_cache.cached_block(block_id)
            if cached is not None:
                block_hash, parent, token_ids = cached
                blocks.append((block_hash, block_id, parent, token_ids))
        return self.offload.plan_saves(blocks)

    # ------------------------------------------------------------------ release
    def free(self, request: Request) -> None:
        """Drop all the request's blocks, tail first, and reset its KV progress."""
        if request.block_ids:
            self.pool.free(request.block_ids[::-1])
        request.block_ids = []
        request.pending_block_copies = []  # the copied-into block was freed with the rest
        request.num_computed_tokens = 0
        request.num_inserted_blocks = 0

    def fork(self, parent: Request, child: Request) -> None:
        """Share all of ``parent``'s blocks with ``child`` (which must hold none)."""
        if child.block_ids:
            raise ValueError(f"fork target {child.request_id!r} already holds blocks")
        self.pool.incref(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_inserted_blocks = parent.num_inserted_blocks
