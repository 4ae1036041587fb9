"""KV cache groups: the layers that share one block table.

A hybrid model mixes full-attention layers with sliding-window layers. A sliding layer of
window ``W`` only ever reads the last ``W`` positions, so the blocks behind that window
can go back to the pool while the full layers keep the whole context. Layers are grouped
by attention kind (full, or sliding with window ``W``); each request holds one block table
per group, and all groups draw from one ``BlockPool``, so memory flows between them.

One pool needs one block size in bytes, so every group has the same number of layers,
``group_size`` (the last group of a kind may be short, its unused positions padding).
The KV storage keeps ``group_size`` buffer pairs; the layer at position ``i`` of any group
stores its KV in buffer ``i``, and a block id handed to group ``g`` means "these
``block_size`` tokens of the layers of group ``g``". A block belongs to one group at a time.

Group 0 is a full-attention group whenever the model has one: the prefix cache keys its
tree on group 0's blocks (see ``RadixCache``). A model with only one kind of attention
(or whose layers cannot share buffers) has one group, of every layer, that keeps the whole
context: the layout of a non-hybrid engine.

Blocks one request holds in a sliding group of window ``W`` while it writes position
``p`` (``bs`` = block_size)::

    | released (padding 0) | live: positions > p - W, up to p                    |
    0      (p - W + 1) // bs                                      p // bs

that is at most ``cdiv(W - 1, bs) + 1`` blocks between steps; a prefill chunk of ``n``
tokens holds ``cdiv(W - 1 + n, bs) + 1`` during its step, since every token of the chunk is
written before any is attended.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from kvpage.core.config import check_windows

#: When every kind's layer count is within this factor of the smallest, one group per kind
#: (padding the shorter ones) wastes less than splitting every kind into many small groups.
_NEAR_EQUAL_COUNTS = 1.25


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVGroup:
    """The layers (attention call sites) of one group and their attention kind.

    ``sliding_window`` is ``None`` for full attention, else the window ``W``: a query at
    position ``p`` reads keys at positions ``> p - W``.
    """

    layers: tuple
    sliding_window: Optional[int] = None

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def first_needed_block(self, num_computed_tokens: int, block_size: int) -> int:
        """Index of the first block a query at position ``num_computed_tokens`` (or later) reads."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // block_size

    def blocks_held(self, num_tokens: int, block_size: int, chunk_tokens: int = 1) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds in this group while a step
        writes ``chunk_tokens`` of them."""
        whole = cdiv(num_tokens, block_size)
        if self.sliding_window is None:
            return whole
        return min(whole, cdiv(self.sliding_window - 1 + chunk_tokens, block_size) + 1)


def groups_of_windows(windows: Sequence[Optional[int]]) -> tuple:
    """One layer-less ``KVGroup`` per window (what the block accounting needs); the windows
    as ``CacheConfig.group_windows`` takes them (``check_windows``), else ``ValueError``."""
    return tuple(KVGroup((), w) for w in check_windows(windows))


def blocks_per_request(groups: Sequence[KVGroup], num_tokens: int, block_size: int, chunk_tokens: int = 1) -> int:
    """Blocks one request of ``num_tokens`` tokens holds over ``groups`` while a step writes
    ``chunk_tokens`` of them (the engine's fit check and the planner's figure)."""
    return sum(group.blocks_held(num_tokens, block_size, chunk_tokens) for group in groups)


@dataclass(frozen=True)
class KVCacheGroups:
    """How a model's attention layers map onto block tables and KV buffers.

    Attributes:
        groups: the groups; group 0 is full attention whenever any layer is.
        group_size: layers per group, hence KV buffer pairs in the storage.
        num_layers: attention call sites covered (every site is in exactly one group).
        reason: for a single-group layout, why the model is not hybrid (for the log).
    """

    groups: tuple
    group_size: int
    num_layers: int
    reason: str = ""

    def __post_init__(self) -> None:
        seen = sorted(layer for group in self.groups for layer in group.layers)
        if seen != list(range(self.num_layers)):
            raise ValueError(f"groups must cover layers 0..{self.num_layers - 1} once each, got {seen}")
        if any(len(group.layers) > self.group_size for group in self.groups):
            raise ValueError(f"a group has more than group_size={self.group_size} layers")

    @classmethod
    def single(cls, num_layers: int, reason: str = "") -> "KVCacheGroups":
        """One group of every layer, keeping the whole context (no hybrid memory)."""
        return cls((KVGroup(tuple(range(num_layers))),), num_layers, num_layers, reason)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_hybrid(self) -> bool:
        return any(group.is_sliding for group in self.groups)

    @property
    def windows(self) -> tuple:
        """Each group's sliding window (``None``: full attention), in group order."""
        return tuple(group.sliding_window for group in self.groups)

    def position_of_layer(self, layer: int) -> tuple:
        """``(group, position in the group)`` of layer ``layer``: its block table and its buffer."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")

    def blocks_per_request(self, num_tokens: int, block_size: int, chunk_tokens: int = 1) -> int:
        """``blocks_per_request`` over these groups."""
        return blocks_per_request(self.groups, num_tokens, block_size, chunk_tokens)


def plan_kv_groups(windows: Sequence[Optional[int]], hybrid: bool = True,
                   shareable: bool = True, why_not_shareable: str = "") -> KVCacheGroups:
    """Group attention layers by kind, given each layer's sliding window (``None``: full).

    One group of every layer (the non-hybrid layout) when ``hybrid`` is off, when the layers
    cannot share buffers (``shareable`` False: different KV layouts or cross-layer KV
    reuse; ``why_not_shareable`` says which), when every layer has the same kind, or when
    no layer has full attention (the prefix cache keys on a full-attention group).
    """
    windows = [None if not w else int(w) for w in windows]
    num_layers = len(windows)
    if num_layers == 0:  # recurrent layers only: one empty group, the pool counts tokens
        return KVCacheGroups.single(0, "the model has no attention layers")
    kinds: dict = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    if not hybrid:
        return KVCacheGroups.single(num_layers, "the hybrid KV cache manager is disabled")
    if len(kinds) == 1:
        return KVCacheGroups.single(num_layers, "every layer has the same attention kind")
    if None not in kinds:
        return KVCacheGroups.single(num_layers, "no layer has full attention")
    if not shareable:
        return KVCacheGroups.single(num_layers, why_not_shareable or "the layers cannot share KV buffers")
    counts = [len(layers) for layers in kinds.values()]
    size = min(counts)
    if max(counts) <= _NEAR_EQUAL_COUNTS * size:
        size = max(counts)
    # Full attention first (group 0), then sliding kinds by window.
    order = [None] + sorted(w for w in kinds if w is not None)
    groups = [KVGroup(tuple(kinds[w][i : i + size]), w) for w in order for i in range(0, len(kinds[w]), size)]
    return KVCacheGroups(tuple(groups), size, num_layers)
