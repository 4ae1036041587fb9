"""Per-request block tables: which blocks a request holds, and when it needs more.

Block regions of one request, in tokens (``bs`` = block_size)::

    |<- cached (prefix hit) ->|<- computed ->|<- new this step ->|<- free slots ->|
    0                  num_cached    num_computed        num_computed + n    len(block_ids) * bs

Blocks are appended as tokens need slots; full blocks never change again, so only the
block receiving new tokens can be shared *and* written, which is where copy-on-write
applies.

With several KV groups (``kv_groups``: a hybrid model's full and sliding-window layers)
a request holds one table per group, all covering the same token positions and grown
together from the one pool. ``KVCacheManager`` coordinates one manager per kind
(``kind_managers``: full attention, sliding window, recurrent state) and the prefix-cache
side (``prefix_hits``: matching, locking, host loads, offering filled blocks).
"""
from __future__ import annotations

import numbers

from typing import TYPE_CHECKING, Optional, Sequence

from kvpage.core.kv.block_pool import BlockPool
from kvpage.core.kv.kind_managers import GroupManager, KVKindManager, RecurrentStateManager, group_manager
from kvpage.core.kv.kv_groups import blocks_per_request, cdiv, groups_of_windows
from kvpage.core.kv.prefix_hits import PrefixHits
from kvpage.core.kv.radix_cache import RadixCache
from kvpage.core.kv.radix_node import PrefixMatch
from kvpage.core.kv.state_slots import StateSlotPool
from kvpage.core.request import Request

if TYPE_CHECKING:
    from kvpage.core.offload.kv_offload import KVOffloadManager
    from kvpage.core.offload.kv_transfers import DiskOp


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
        self.groups = groups_of_windows(windows)
        if prefix_cache is not None and prefix_cache.pool is not pool:
            raise ValueError("the prefix cache must cache blocks of the manager's own pool")
        if pool.num_tags < len(self.groups):
            raise ValueError(f"{len(self.groups)} KV groups need a pool with as many tags, got num_tags={pool.num_tags}")
        if offload is not None and len(self.groups) > 1:
            raise ValueError("the lower KV tiers keep one block table per request: they need a single KV group")
        self.pool = pool
        self.block_size = pool.block_size
        self.num_groups = len(self.groups)
        self.sliding_groups = tuple(g for g, group in enumerate(self.groups) if group.is_sliding)
        self.hits = PrefixHits(pool, prefix_cache, offload)
        self._group_managers: tuple[GroupManager, ...] = tuple(
            group_manager(g, group, pool) for g, group in enumerate(self.groups))
        self._sliding_managers = tuple(self._group_managers[g] for g in self.sliding_groups)
        self._state = RecurrentStateManager(state_slots) if state_slots is not None else None
        # Every kind a request holds, in fork order: the state slot first (a fork may fail there).
        self._kinds: tuple[KVKindManager, ...] = (*((self._state,) if self._state is not None else ()),
                                                  *self._group_managers)
        self.num_pool_hit_tokens = 0  # tokens served by pool blocks, over every admission

    # ------------------------------------------------------------------ admission
    def match_prefix(self, request: Request) -> PrefixMatch:
        """Cached blocks the request may reuse; at least one token is always left to compute.

        Does not lock the blocks: pass the match to ``allocate_slots`` in the same step.
        """
        return self.hits.match(request)

    def num_blocks_needed(self, request: Request, num_new_tokens: int, hit: Optional[PrefixMatch] = None) -> int:
        """Fresh blocks ``allocate_slots`` would take (including a copy-on-write copy)."""
        held = max(len(request.block_ids), len(hit.block_ids) if hit else 0)
        computed = max(request.num_computed_tokens, hit.num_tokens if hit else 0)
        needed = cdiv(computed + num_new_tokens, self.block_size) - held
        # A blockless request (tables maybe not yet one per group) has nothing to copy.
        copies = sum(m.needs_copy(request, num_new_tokens) for m in self._group_managers) if request.block_ids else 0
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
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, numbers.Integral) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an integer >= 0, got {num_new_tokens!r}")
        state = self._state
        if state is not None and not state.has_room(request):
            return False
        if num_new_tokens == 1 and hit is None and self._decode_in_place(request):
            return True
        self._ensure_tables(request)
        for manager in self._sliding_managers:
            manager.release_out_of_window(request)
        if hit is not None and hit.num_tokens and not self._take_hit(request, num_new_tokens, hit):
            return False
        start = request.num_computed_tokens
        end = start + num_new_tokens
        if not self._grow(request, num_new_tokens):
            return False
        if hit is not None and hit.load_hashes:
            start = self.hits.plan_host_loads(request, hit)  # the loaded blocks are full too
        for manager in self._group_managers:
            manager.raise_fill(request, start, end)
        if state is not None:
            state.attach(request)
        return True

    def _decode_in_place(self, request: Request) -> bool:
        """The fast path of most decodes: if the one new token lands inside a private, partly
        filled block of every group, record it there and return True (nothing allocated)."""
        index, offset = divmod(request.num_computed_tokens, self.block_size)
        if not offset:
            return False
        pool = self.pool
        tables = request.block_tables
        if not all(pool.ref_count(table[index]) == 1 for table in tables):
            return False
        for table in tables:
            pool.raise_fill(table[index], offset + 1)
        return True

    def _ensure_tables(self, request: Request) -> None:
        """Give a request that never held blocks one (empty) table per group."""
        if len(request.block_tables) == self.num_groups:
            return
        if any(request.block_tables):
            raise ValueError(f"request {request.request_id!r} holds {len(request.block_tables)} block tables, "
                             f"this cache has {self.num_groups} groups")
        request.block_tables = [[] for _ in self.groups]
        request.released_blocks = [0] * self.num_groups

    def _take_hit(self, request: Request, num_new_tokens: int, hit: PrefixMatch) -> bool:
        """Lock the hit's pool blocks and its host entries, or change nothing and return False."""
        if request.block_ids:
            raise ValueError(
                f"request {request.request_id!r} already holds blocks; a prefix hit applies only at admission"
            )
        locked = self.hits.blocks_to_lock(hit)
        # Locking an idle cached block takes it out of the free count just like a fresh one.
        idle_hits = sum(1 for b in locked if self.pool.ref_count(b) == 0)
        if self.num_blocks_needed(request, num_new_tokens, hit) + idle_hits > self.pool.num_free_blocks:
            return False
        self.hits.lock(request, hit, locked)
        self.num_pool_hit_tokens += len(hit.block_ids) * self.block_size
        return True

    def _grow(self, request: Request, num_new_tokens: int) -> bool:
        """Give every group blocks up to position ``num_computed_tokens + num_new_tokens``,
        first copying a shared partial block the new tokens land in; False, changing
        nothing, when the pool is short.

        Blocks of one group's table, in tokens::

            | held: len(block_ids) * bs | missing: appended in every group |
            0                                          cdiv(end, bs) * bs
        """
        end = request.num_computed_tokens + num_new_tokens
        missing = cdiv(end, self.block_size) - len(request.block_ids)  # the same in every group
        copies = [m for m in self._group_managers if m.needs_copy(request, num_new_tokens)]
        if missing <= 0 and not copies:
            return True
        if max(missing, 0) * self.num_groups + len(copies) > self.pool.num_free_blocks:
            return False
        for manager in copies:
            manager.copy_on_write(request)
        if missing > 0:
            for manager in self._group_managers:
                manager.append_blocks(request, missing)
        return True

    # ------------------------------------------------------------------ sliding windows
    def release_out_of_window(self, request: Request) -> None:
        """Give back the blocks of each sliding group that no query of ``request`` will read
        again (wholly before the window of its next position, ``num_computed_tokens``).

        A cached one stays in the prefix cache, evictable; the entries become padding.
        """
        for manager in self._sliding_managers:
            manager.release_out_of_window(request)

    def group_stats(self) -> list[dict]:
        """Per group: its window (``None``: full), blocks its requests hold, the share of the
        pool that is, and the share of their token slots holding no token."""
        return [manager.stats() for manager in self._group_managers]

    def blocks_held(self, num_tokens: int, chunk_tokens: int = 1) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds over all groups while a
        step writes ``chunk_tokens`` of them."""
        return blocks_per_request(self.groups, num_tokens, self.block_size, chunk_tokens)

    def take_state_copies(self) -> list[tuple[int, int]]:
        """(src, dst) state-slot copies the runner performs, in order, before the next
        forward; each is handed out once."""
        return self._state.take_copies() if self._state is not None else []

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
        return self.hits.offer(request, num_new_tokens)

    def plan_disk_saves(self, block_ids: Sequence[int]) -> list["DiskOp"]:
        """Disk ops saving those of ``block_ids`` (head first) that are still cached and not
        on disk yet (``KVOffloadManager.plan_saves``); call after their step succeeded."""
        return self.hits.plan_disk_saves(block_ids)

    # ------------------------------------------------------------------ release
    def free(self, request: Request) -> None:
        """Drop all the request's blocks, tail first, and its state slot; reset its KV progress."""
        if request.block_ids or request.state_slot is not None:  # else it holds nothing
            for manager in self._kinds:
                manager.free(request)
        request.block_tables = [[] for _ in request.block_tables]
        request.released_blocks = [0] * len(request.block_tables)
        request.pending_block_copies = []  # the copied-into block was freed with the rest
        request.num_computed_tokens = 0
        request.num_inserted_blocks = 0

    def fork(self, parent: Request, child: Request) -> None:
        """Share all of ``parent``'s blocks with ``child`` (which must hold none); with state
        slots the child gets its own, copied from the parent's before the next forward."""
        if any(child.block_tables):
            raise ValueError(f"fork target {child.request_id!r} already holds blocks")
        for manager in self._kinds:
            manager.fork(parent, child)
        child.block_tables = [list(table) for table in parent.block_tables]
        child.released_blocks = list(parent.released_blocks)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_inserted_blocks = parent.num_inserted_blocks
