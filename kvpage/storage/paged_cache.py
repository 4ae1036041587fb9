"""The paged KV buffers: per-layer K and V arrays of ``num_blocks`` blocks.

Backend-neutral and torch-free at import: numpy buffers work everywhere, torch (CPU
tensors) and cupy (GPU) are imported only when asked for.

Layout of layer ``l`` (``spec.layers[l]``, a ``LayerKVSpec``), one buffer for K, one for V::

    K: [num_blocks, block_size, k_heads, k_head_dim]   (slot = block_id * block_size + offset)
    V: [num_blocks, block_size, v_heads, v_head_dim]

in the spec's KV format: the model's dtype, another unquantized dtype, or for a quantized
``kv_cache_dtype`` (fp8, int8, int4) uint8 ``[num_blocks, block_bytes]``, each block its
token rows' codes then their scales (``KVFormat.block_regions``). Either way block ``b`` is
``buf[b]``, so copy-on-write, the host and disk tiers move blocks without knowing the format.

A layer that reuses another layer's KV has no buffers: it reads its owner's.

With hybrid KV groups (``kvpage.core.kv.kv_groups``: a model mixing sliding-window and full
layers) there are ``group_size`` buffer pairs instead, and the layer at position ``i`` of
its group uses pair ``i``; a block id then means the same tokens only within one group.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kvpage.core.kv.kv_groups import KVCacheGroups
from kvpage.platform.huge_pages import advise_huge_pages
from kvpage.core.kv_formats import CacheFormat, KVFormat
from kvpage.storage.spec import KVCacheSpec, LayerKVSpec

_BACKENDS = ("numpy", "torch", "cupy")


class PagedKVCache:
    """Per-layer K and V buffers, shaped by ``spec.layers`` (see the module docstring).

    ``backend``: "numpy" (numpy arrays), "torch" (CPU tensors), "cupy" (GPU arrays; each
    also viewable zero-copy as a torch CUDA tensor through DLPack, ``torch_key_cache``).
    Buffers start zeroed. Only layers that own buffers allocate; ``key_cache(l)`` of a
    layer that reuses another's returns its owner's buffer (the same object).
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, backend: str = "numpy",
                 groups: Optional[KVCacheGroups] = None) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if groups is not None and groups.num_layers != spec.num_layers:
            raise ValueError(f"groups cover {groups.num_layers} layers, the spec has {spec.num_layers}")
        self.spec, self.num_blocks, self.backend = spec, num_blocks, backend
        self.groups = groups if groups is not None and groups.is_hybrid else None
        self._xp = _array_module(backend)
        own_k, own_v = {}, {}
        if self.groups is None:
            for i in spec.owner_layers:
                own_k[i], own_v[i] = self._pair(spec.layers[i])
            self._k = [own_k[spec.owner_of(i)] for i in range(spec.num_layers)]
            self._v = [own_v[spec.owner_of(i)] for i in range(spec.num_layers)]
        else:
            for position in range(self.groups.group_size):
                own_k[position], own_v[position] = self._pair(spec.layers[0])
            positions = [self.groups.position_of_layer(i)[1] for i in range(spec.num_layers)]
            self._k = [own_k[p] for p in positions]
            self._v = [own_v[p] for p in positions]
        self._owned = [*own_k.values(), *own_v.values()]

    def _pair(self, layer: LayerKVSpec) -> tuple:
        bs, shape = self.spec.block_size, self.spec.kv_format.buffer_shape
        return (self._zeros(shape(self.num_blocks, bs, layer.k_heads, layer.k_head_dim)),
                self._zeros(shape(self.num_blocks, bs, layer.v_heads, layer.v_head_dim)))

    def _zeros(self, shape: tuple) -> Any:
        dtype = self.spec.kv_format.storage_dtype
        if self.backend == "torch":
            buf = self._xp.empty(shape, dtype=getattr(self._xp, dtype))
            advise_huge_pages(buf.data_ptr(), buf.numel() * buf.element_size())  # before the first touch
            return buf.zero_()
        if dtype == "bfloat16":
            raise ValueError(f"bfloat16 needs the torch backend ({self.backend} has no bfloat16)")
        if self.backend == "numpy":
            buf = np.empty(shape, dtype=dtype)
            advise_huge_pages(buf.ctypes.data, buf.nbytes)
            buf[...] = 0
            return buf
        return self._xp.zeros(shape, dtype=dtype)

    @property
    def kv_format(self) -> KVFormat:
        """The buffers' storage format (``spec.kv_format``, a ``KVFormat``)."""
        return self.spec.kv_format

    @property
    def cache_format(self) -> CacheFormat:
        """``spec.cache_format``: what a kernel needs besides a buffer to read it."""
        return self.spec.cache_format

    @property
    def nbytes(self) -> int:
        """Bytes held by all K and V buffers (each shared buffer once)."""
        return self.num_blocks * self.spec.bytes_per_block_of(self.groups)

    def _live(self) -> None:
        if self._k is None:
            raise ValueError("PagedKVCache was freed")

    def key_cache(self, layer: int) -> Any:
        self._live()
        return self._k[layer]

    def value_cache(self, layer: int) -> Any:
        self._live()
        return self._v[layer]

    def torch_key_cache(self, layer: int) -> Any:
        """Layer ``layer``'s K buffer as a torch tensor (zero-copy; DLPack for cupy)."""
        return _as_torch(self.key_cache(layer))

    def torch_value_cache(self, layer: int) -> Any:
        return _as_torch(self.value_cache(layer))

    def copy_blocks(self, block_copies) -> None:
        """Copy-on-write: for each ``(src, dst)`` row of int ``[K, 2]``, block dst := block src.

        One fancy-index copy per owned buffer (sources are read before any write, so a
        block may be both a source and a destination). Destinations must be distinct.
        """
        self._live()
        pairs = np.asarray(block_copies, dtype=np.int64).reshape(-1, 2)
        if pairs.shape[0] == 0:
            return
        if pairs.min() < 0 or pairs.max() >= self.num_blocks:
            raise ValueError(f"block_copies reference blocks outside [0, {self.num_blocks})")
        if np.unique(pairs[:, 1]).shape[0] != pairs.shape[0]:
            raise ValueError("block_copies has a repeated destination block")
        src, dst = self._index(pairs[:, 0]), self._index(pairs[:, 1])
        for buf in self._owned:
            buf[dst] = buf[src]

    def _index(self, ids: np.ndarray) -> Any:
        if self.backend == "torch":
            return self._xp.from_numpy(ids)
        return self._xp.asarray(ids)

    def zero(self) -> None:
        """Zero every buffer in place."""
        self._live()
        for buf in self._owned:
            buf[...] = 0

    def free(self) -> None:
        """Drop the buffers (device memory returns to the pool once no view holds them)."""
        self._k = self._v = None
        self._owned = []
        if self.backend == "cupy":
            self._xp.get_default_memory_pool().free_all_blocks()


def _array_module(backend: str) -> Any:
    if backend == "numpy":
        return np
    if backend == "torch":
        import torch

        return torch
    import cupy

    return cupy


def _as_torch(buf: Any) -> Any:
    import torch

    if isinstance(buf, torch.Tensor):
        return buf
    if isinstance(buf, np.ndarray):
        return torch.from_numpy(buf)
    return torch.from_dlpack(buf)
