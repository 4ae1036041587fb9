"""The KV cache's shape: one ``LayerKVSpec`` per attention layer, gathered in a ``KVCacheSpec``.

A layer's layout is what one token stores in it: K rows ``[k_heads, k_head_dim]`` and V
rows ``[v_heads, v_head_dim]``. ``KVCacheSpec`` adds the block size, the model's dtype and
the KV cache format (``kv_cache_dtype``, ``kvpage.core.kv_formats``), and derives bytes per
token and per block (a quantized format's scales included), the layers that own buffers,
and the KV groups. Pure and torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvpage.core.kv.kv_groups import KVCacheGroups, plan_kv_groups
from kvpage.core.kv_formats import MODEL_DTYPES, CacheFormat, KVFormat, resolve_kv_format


@dataclass(frozen=True, slots=True)
class LayerKVSpec:
    """The KV layout of one attention layer: what one token stores in it.

    K rows are ``[k_heads, k_head_dim]`` and V rows ``[v_heads, v_head_dim]``; they differ in
    MLA models (DeepSeek-V2/V3, MiniCPM3: V's head is smaller than K's, which carries the
    rotary part). ``reuses`` names an earlier layer whose K/V this layer reads instead of
    its own (cross-layer KV sharing, as in Gemma3n): such a layer allocates nothing, and
    its layout must equal its owner's. A ``v_head_dim`` of 0 is a site that stores keys
    only: a DSA indexer's keys (``adapters.sparse_indexer``).

    Two layers with equal fields (``reuses`` aside) have interchangeable buffers; that is
    the key to group layers by (``KVCacheSpec.layers_by_layout``).
    """

    k_heads: int
    k_head_dim: int
    v_heads: int
    v_head_dim: int
    reuses: Optional[int] = None
    sliding_window: Optional[int] = None  # the layer's attention kind: None is full attention
    # Chunked attention (Llama 4): a query sees only keys of its own chunk of this many
    # positions. The layer keeps its whole context (it is grouped as full attention).
    attention_chunk: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("k_heads", "k_head_dim", "v_heads"):
            _check_positive(name, getattr(self, name))
        if self.v_head_dim != 0:  # 0: a site that stores keys only (a DSA indexer's)
            _check_positive("v_head_dim", self.v_head_dim)
        for name in ("sliding_window", "attention_chunk"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.reuses is not None and (isinstance(self.reuses, bool) or not isinstance(self.reuses, int)
                                        or self.reuses < 0):
            raise ValueError(f"reuses must be None or a layer index >= 0, got {self.reuses!r}")

    @classmethod
    def symmetric(cls, num_kv_heads: int, head_dim: int, reuses: Optional[int] = None,
                  sliding_window: Optional[int] = None) -> "LayerKVSpec":
        """K and V of one shape (every model but MLA)."""
        return cls(num_kv_heads, head_dim, num_kv_heads, head_dim, reuses, sliding_window)

    @property
    def layout(self) -> "LayerKVSpec":
        """This layout without ``reuses`` or the window (what a buffer of it looks like)."""
        return LayerKVSpec(self.k_heads, self.k_head_dim, self.v_heads, self.v_head_dim)

    @property
    def elements_per_token(self) -> int:
        """K plus V elements of one token in this layer's own buffers (0 if it reuses another's)."""
        if self.reuses is not None:
            return 0
        return self.k_heads * self.k_head_dim + self.v_heads * self.v_head_dim


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the KV cache of one model: one ``LayerKVSpec`` per attention layer.

    Strictly, per attention *call site*: a layer that calls attention more than once per
    forward (differential attention, a stack reused across recurrence cycles) has one entry
    per call, in layer order. Every entry that owns buffers has one K and one V buffer of
    ``num_blocks`` blocks (all share one block table, so a block id means the same tokens in
    every layer).

    Attributes:
        layers: the layers' layouts, in layer order (``layers[i]`` is layer ``i``).
        block_size: tokens per block.
        dtype: the model's K/V dtype: "float32", "float16" or "bfloat16".
        kv_cache_dtype: how the cache stores K/V (``kvpage.core.kv_formats.KV_CACHE_DTYPES``):
            "auto" is ``dtype``; a quantized format ("fp8", "int8", "int4", ...) stores each
            token's rows as codes plus scales, ``[num_blocks, block_bytes]`` uint8 buffers.
            Every layer's head size must take the format (int4 needs even ones).
    """

    layers: tuple
    block_size: int
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        # Empty for a model with recurrent layers only (Mamba): its pool just counts tokens.
        if not all(isinstance(layer, LayerKVSpec) for layer in self.layers):
            raise ValueError(f"layers must be a sequence of LayerKVSpec, got {self.layers!r}")
        for index, layer in enumerate(self.layers):
            if layer.reuses is None:
                continue
            if layer.reuses >= index or self.layers[layer.reuses].reuses is not None:
                raise ValueError(f"layer {index} reuses layer {layer.reuses}, which is not an earlier layer "
                                 "with buffers of its own")
            if layer.layout != self.layers[layer.reuses].layout:
                raise ValueError(f"layer {index} reuses layer {layer.reuses}, whose KV layout differs")
        _check_positive("block_size", self.block_size)
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(MODEL_DTYPES)}, got {self.dtype!r}")
        kv_format = resolve_kv_format(self.kv_cache_dtype, self.dtype)
        for index in self.owner_layers:
            layer = self.layers[index]
            try:
                kv_format.check_head_dim(layer.k_head_dim)
                kv_format.check_head_dim(layer.v_head_dim)
            except ValueError as exc:
                raise ValueError(f"layer {index}: {exc}") from None
        # Resolved once (a frozen dataclass without slots keeps it beside the fields).
        object.__setattr__(self, "_kv_format", kv_format)

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                dtype: str = "float32", kv_cache_dtype: str = "auto") -> "KVCacheSpec":
        """``num_layers`` layers with K and V of ``[num_kv_heads, head_dim]`` each."""
        _check_positive("num_layers", num_layers)
        return cls((LayerKVSpec.symmetric(num_kv_heads, head_dim),) * num_layers, block_size, dtype,
                   kv_cache_dtype)

    @property
    def kv_format(self) -> KVFormat:
        """The storage format of every K and V buffer (``kv_cache_dtype`` resolved)."""
        return self._kv_format

    @property
    def cache_format(self) -> CacheFormat:
        """What an attention kernel needs besides a buffer to read it: format and block size."""
        return CacheFormat(self._kv_format, self.block_size)

    @property
    def num_layers(self) -> int:
        """Attention layers, including those that reuse another layer's KV."""
        return len(self.layers)

    @property
    def owner_layers(self) -> tuple:
        """Indices of the layers that have buffers of their own."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.reuses is None)

    def owner_of(self, layer: int) -> int:
        """The layer whose buffers layer ``layer`` reads (itself unless it reuses another's)."""
        reuses = self.layers[layer].reuses
        return layer if reuses is None else reuses

    def layers_by_layout(self) -> dict:
        """Owner layers grouped by layout: ``{LayerKVSpec (reuses None): (layer, ...)}``, in
        first-seen order. Layers of one group have buffers of one shape."""
        groups: dict = {}
        for i in self.owner_layers:
            groups.setdefault(self.layers[i].layout, []).append(i)
        return {layout: tuple(indices) for layout, indices in groups.items()}

    def kv_groups(self, hybrid: bool = True) -> KVCacheGroups:
        """The layers' KV groups (``plan_kv_groups``): one per attention kind when ``hybrid``
        and the layers can share buffers (one layout, no cross-layer reuse), else one."""
        reason = ""
        if any(layer.reuses is not None for layer in self.layers):
            reason = "some layers reuse another layer's KV"
        elif len(self.layers_by_layout()) > 1:
            reason = "the layers' KV layouts differ"
        return plan_kv_groups([layer.sliding_window for layer in self.layers], hybrid, not reason, reason)

    def bytes_per_block_of(self, groups: Optional[KVCacheGroups]) -> int:
        """Bytes of one pool block: every owner layer's, or with hybrid ``groups`` one block of
        ``group_size`` layers."""
        if groups is None or not groups.is_hybrid:
            return self.bytes_per_block
        return groups.group_size * self.block_size * self.layer_bytes_per_token(self.layers[0])

    def layer_bytes_per_token(self, layer: LayerKVSpec) -> int:
        """Bytes one token stores in ``layer``'s own K and V buffers in this spec's format
        (codes and scales; 0 for a layer that reuses another's)."""
        if layer.reuses is not None:
            return 0
        row_bytes = self._kv_format.row_bytes
        return layer.k_heads * row_bytes(layer.k_head_dim) + layer.v_heads * row_bytes(layer.v_head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V of one token, summed over the layers that own buffers (a
        quantized format's scales included)."""
        return sum(self.layer_bytes_per_token(layer) for layer in self.layers)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V of one block, all layers."""
        return self.block_size * self.bytes_per_token

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` tokens needs."""
        return -(-num_tokens // self.block_size)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
