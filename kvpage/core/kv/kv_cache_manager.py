"""Per-request block tables: which blocks a request holds, and when it needs more.

Block regions of one request, in tokens (``bs`` = block_size)::

    |<- cached (prefix hit) ->|<- computed ->|<- new this step ->|<- free slots ->|
    0                  num_cached    num_computed        num_computed + n    len(block_ids) * bs

Blocks are appended as tokens need slots; full blocks never change again, so only the
block receiving new tokens can be shared *and* written, which is where copy-on-write
applies.

With several KV groups (``kv_groups``: a hybrid model's full and sliding-window layers)
a request holds one table per group, all covering the same token positions and grown
together from the one pool. In a sliding group the blocks behind the window go back to
the pool (``release_out_of_window``), or, if cached, stay in the prefix cache as
evictable; their table entries become padding.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from kvpage.core.kv.block_pool import BlockPool
from kvpage.core.kv.kv_groups import blocks_per_request, cdiv, groups_of_windows
from kvpage.core.kv.radix_cache import PrefixMatch, RadixCache
from kvpage.core.request import Request
from kvpage.core.kv.state_slots import StateSlotPool

if TYPE_CHECKING:
    from kvpage.core.offload.kv_offload import KVOffloadManager

_NO_HIT = PrefixMatch((), 0)


class KVCacheManager:
    """Owns the mapping request -> blocks over one ``BlockPool`` and optional ``RadixCache``
    (with an optional ``KVOffloadManager`` for the lower tiers under it)."""

    def __init__(self, pool: BlockPool, prefix_cache: Optional[RadixCache] = None,
                 offload: Optional["KVOffloadManager"] = None, windows: Sequence[Optional[int]] = (None,),
                 state_slots: Optional[StateSlotPool] = None) -> None:
        """``windows``: each KV group's sliding window (``None``: full attention); group 0
        must be full attention. Lower tiers (``offload``) need a single group. With
        ``state_slots`` (a model with recurrent layers) every request holding blocks also
        holds one state slot; the state covers exactly its computed tokens, so such a
        cache takes no prefix hits."""
        if state_slots is not None and (prefix_cache is not None or offload is not None):
            raise ValueError("recurrent state cannot be rebuilt from cached KV blocks: state slots need "
                             "enable_prefix_caching off and no KV tiers")
        self.state_slots = state_slots
        self.pending_state_copies: list[tuple[int, int]] = []  # (src, dst) slot copies owed by forks
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.offload = offload
        self.block_size = pool.block_size
        self.groups = groups_of_windows(windows)
        if offload is not None and len(self.groups) > 1:
            raise ValueError("the lower KV tiers keep one block table per request: they need a single KV group")
        self.num_groups = len(self.groups)
        self.sliding_groups = tuple(g for g, group in enumerate(self.groups) if group.is_sliding)
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
        copies = sum(self._needs_copy(request, g, num_new_tokens) for g in range(len(request.block_tables)))
        return max(needed, 0) * self.num_groups + copies

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: Optional[PrefixMatch] = None) -> bool:
        """Reserve KV slots for ``num_new_tokens`` more tokens of ``request``.

        With ``hit`` (only for a request holding no blocks) the cached blocks are locked
        first and the request's computed tokens jump to the end of the hit; the hit's host
        blocks get fresh pool blocks, loaded before the step's forward (and cached with the
        step's other full blocks by ``cache_scheduled_blocks``). In every group the same
        positions get blocks; sliding groups first give back what left their window.
        Returns False, changing nothing else, when the pool cannot supply the blocks (or,
        with state slots, a request without one finds none free).
        """
        tables = request.block_tables
        slots = self.state_slots
        if slots is not None and request.state_slot is None and slots.num_free == 0:
            return False
        if num_new_tokens == 1 and hit is None:
            # Fast path for most decodes: the token lands inside a private, partly filled block.
            index, offset = divmod(request.num_computed_tokens, self.block_size)
            if offset and all(self.pool.ref_count(table[index]) == 1 for table in tables):
                for table in tables:
                    self.pool.raise_fill(table[index], offset + 1)
                return True
        if len(tables) != self.num_groups:
            if any(tables):
                raise ValueError(f"request {request.request_id!r} holds {len(tables)} block tables, "
                                 f"this cache has {self.num_groups} groups")
            request.block_tables = tables = [[] for _ in self.groups]
            request.released_blocks = [0] * self.num_groups
        if self.sliding_groups:
            self.release_out_of_window(request)
        if hit is not None and hit.num_tokens:
            if request.block_ids:
                raise ValueError(
                    f"request {request.request_id!r} already holds blocks; a prefix hit applies only at admission"
                )
            if not self._take_hit(request, num_new_tokens, hit):
                return False
        start = request.num_computed_tokens
        end = start + num_new_tokens
        missing = cdiv(end, self.block_size) - len(request.block_ids)  # the same in every group
        copies = [g for g in range(self.num_groups) if self._needs_copy(request, g, num_new_tokens)]
        if missing > 0 or copies:
            if max(missing, 0) * self.num_groups + len(copies) > self.pool.num_free_blocks:
                return False
            for g in copies:
                self._copy_on_write(request, g)
            if missing > 0:
                for g, table in enumerate(tables):
                    table.extend(self.pool.allocate(missing, g))
        if hit is not None and hit.load_hashes:
            first = len(hit.block_ids)
            self.offload.plan_loads(hit.load_hashes, request.block_ids[first : first + len(hit.load_hashes)])
            start = first * self.block_size  # the loaded blocks are full too
        self._update_fill(request, start, end)
        if slots is not None and request.state_slot is None:
            request.state_slot = slots.allocate()
        return True

    def _take_hit(self, request: Request, num_new_tokens: int, hit: PrefixMatch) -> bool:
        """Lock the hit's pool blocks and its host entries, or change nothing and return False."""
        # Locking an idle cached block takes it out of the free count just like a fresh one.
        locked = [*hit.block_ids, *(b for _, blocks in hit.group_blocks for b in blocks)]
        idle_hits = sum(1 for b in locked if self.pool.ref_count(b) == 0)
        if self.num_blocks_needed(request, num_new_tokens, hit) + idle_hits > self.pool.num_free_blocks:
            return False
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
        self.num_pool_hit_tokens += len(hit.block_ids) * self.block_size
        return True

    def _needs_copy(self, request: Request, group: int, num_new_tokens: int) -> bool:
        """True when the new tokens land in a partially filled block of ``group`` that
        someone else also holds."""
        offset = request.num_computed_tokens % self.block_size
        table = request.block_tables[group]
        if num_new_tokens <= 0 or offset == 0 or not table:
            return False
        return self.pool.ref_count(table[request.num_computed_tokens // self.block_size]) > 1

    def _copy_on_write(self, request: Request, group: int) -> None:
        table = request.block_tables[group]
        index = request.num_computed_tokens // self.block_size
        shared = table[index]
        (private,) = self.pool.allocate(1, group)
        self.pool.set_fill(private, self.pool.fill(shared))
        self.pool.free([shared])
        table[index] = private
        # A block id means the same tokens in every buffer, so one copy serves any group.
        request.pending_block_copies.append((shared, private))

    def _update_fill(self, request: Request, start: int, end: int) -> None:
        bs = self.block_size
        for table in request.block_tables:
            for index in range(start // bs, cdiv(end, bs)):
                self.pool.raise_fill(table[index], min(end - index * bs, bs))

    # ------------------------------------------------------------------ sliding windows
    def release_out_of_window(self, request: Request) -> None:
        """Give back the blocks of each sliding group that no query of ``request`` will read
        again (wholly before the window of its next position, ``num_computed_tokens``).

        A cached one stays in the prefix cache, evictable; the entries become padding.
        """
        for g in self.sliding_groups:
            table = request.block_tables[g]
            first = min(self.groups[g].first_needed_block(request.num_computed_tokens, self.block_size), len(table))
            released = request.released_blocks[g]
            if first > released:
                self.pool.free(table[released:first])
                table[released:first] = [0] * (first - released)
                request.released_blocks[g] = first

    def group_stats(self) -> list[dict]:
        """Per group: its window (``None``: full), blocks its requests hold, the share of the
        pool that is, and the share of their token slots holding no token."""
        pool = self.pool
        return [{"sliding_window": group.sliding_window, "num_used_blocks": pool.tag_num_used_blocks(g),
                 "usage": pool.tag_usage(g), "fragmentation": pool.tag_fragmentation(g)}
                for g, group in enumerate(self.groups)]

    def blocks_held(self, num_tokens: int, chunk_tokens: int = 1) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds over all groups while a
        step writes ``chunk_tokens`` of them."""
        return blocks_per_request(self.groups, num_tokens, self.block_size, chunk_tokens)

    def take_state_copies(self) -> list[tuple[int, int]]:
        """(src, dst) state-slot copies the runner performs, in order, before the next
        forward; each is handed out once."""
        copies, self.pending_state_copies = self.pending_state_copies, []
        return copies

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
            request.all_token_ids, request.block_ids[:num_full], request.namespace, start_block=start,
            group_tables=request.block_tables[1:],
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
        for g in range(len(request.block_tables)):
            held = request.held_blocks(g)
            if held:
                self.pool.free(held[::-1])
        request.block_tables = [[] for _ in request.block_tables]
        request.released_blocks = [0] * len(request.block_tables)
        request.pending_block_copies = []  # the copied-into block was freed with the rest
        if request.state_slot is not None:
            self.state_slots.free(request.state_slot)
            request.state_slot = None
        request.num_computed_tokens = 0
        request.num_inserted_blocks = 0

    def fork(self, parent: Request, child: Request) -> None:
        """Share all of ``parent``'s blocks with ``child`` (which must hold none)."""
        if any(child.block_tables):
            raise ValueError(f"fork target {child.request_id!r} already holds blocks")
        if self.state_slots is not None:
            slot = self.state_slots.allocate()
            if slot is None:
                raise ValueError(f"cannot fork {parent.request_id!r}: every recurrent-state slot is held")
            child.state_slot = slot
            # Run before the next step's forward, whether or not the child runs in it: the
            # parent's state moves on at its next token. In fork order, so a fork of a fork
            # copies after its parent was filled.
            self.pending_state_copies.append((parent.state_slot, slot))
        for g in range(len(parent.block_tables)):
            self.pool.incref(parent.held_blocks(g))
        child.block_tables = [list(table) for table in parent.block_tables]
        child.released_blocks = list(parent.released_blocks)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_inserted_blocks = parent.num_inserted_blocks
