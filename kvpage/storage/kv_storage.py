"""Paged KV storage: the per-layer KV spec, sizing the pool, and allocating its K/V buffers.

Backend-neutral and torch-free at import: numpy buffers work everywhere, torch (CPU
tensors) and cupy (GPU) are imported only when asked for.

Layout of layer ``l`` (``spec.layers[l]``, a ``LayerKVSpec``), one buffer for K, one for V::

    K: [num_blocks, block_size, k_heads, k_head_dim]   (slot = block_id * block_size + offset)
    V: [num_blocks, block_size, v_heads, v_head_dim]

A layer that reuses another layer's KV has no buffers: it reads its owner's.

With hybrid KV groups (``kvpage.core.kv.kv_groups``: a model mixing sliding-window and full
layers) there are ``group_size`` buffer pairs instead, and the layer at position ``i`` of
its group uses pair ``i``; a block id then means the same tokens only within one group.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from kvpage.core.kv.kv_groups import KVCacheGroups, plan_kv_groups

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}

#: CPU default budget: room for ``max_num_seqs`` sequences of this many tokens (or
#: ``max_model_len`` if shorter) ...
CPU_EXPECTED_SEQ_TOKENS = 1024
#: ... capped at this fraction of free RAM (model weights and activations live there too) ...
CPU_MAX_FREE_RAM_FRACTION = 0.25
#: ... and at this absolute size (bytes): a CPU engine is bandwidth-bound long before a
#: larger cache pays off.
CPU_MAX_KV_BYTES = 4 << 30


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
        dtype: "float32", "float16" or "bfloat16".
    """

    layers: tuple
    block_size: int
    dtype: str = "float32"

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
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"dtype must be one of {sorted(_ITEMSIZE)}, got {self.dtype!r}")

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                dtype: str = "float32") -> "KVCacheSpec":
        """``num_layers`` layers with K and V of ``[num_kv_heads, head_dim]`` each."""
        _check_positive("num_layers", num_layers)
        return cls((LayerKVSpec.symmetric(num_kv_heads, head_dim),) * num_layers, block_size, dtype)

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
        return groups.group_size * self.block_size * self.layers[0].elements_per_token * self.itemsize

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V of one token, summed over the layers that own buffers."""
        return sum(layer.elements_per_token for layer in self.layers) * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V of one block, all layers."""
        return self.block_size * self.bytes_per_token

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` tokens needs."""
        return -(-num_tokens // self.block_size)


def _check_count(num_kv_blocks: object) -> int:
    if isinstance(num_kv_blocks, bool) or not isinstance(num_kv_blocks, int) or num_kv_blocks <= 0:
        raise ValueError(f"num_kv_blocks must be a positive integer, got {num_kv_blocks!r}")
    return num_kv_blocks


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def free_ram_bytes() -> int:
    """Available RAM (bytes): ``MemAvailable`` of /proc/meminfo, else sysconf free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


#: The names of the sizing rules, in precedence order (see ``determine_num_blocks``).
SIZING_RULES = ("explicit count", "byte budget", "GPU profile", "CPU default")


def kv_sizing_rule(num_kv_blocks: Optional[int] = None, kv_cache_memory: Optional[int] = None,
                   device: str = "cpu") -> str:
    """Which of ``SIZING_RULES`` ``determine_num_blocks`` applies to these arguments.

    The one statement of the precedence: an explicit block count, then a byte budget, then
    the GPU profile on a CUDA device, else the CPU default.
    """
    if num_kv_blocks is not None:
        return SIZING_RULES[0]
    if kv_cache_memory is not None:
        return SIZING_RULES[1]
    return SIZING_RULES[2] if device.startswith(("cuda", "gpu")) else SIZING_RULES[3]


def determine_num_blocks(
    spec: KVCacheSpec,
    *,
    num_kv_blocks: Optional[int] = None,
    kv_cache_memory: Optional[int] = None,
    gpu_memory_utilization: Optional[float] = None,
    device: str = "cpu",
    max_num_seqs: int = 1,
    max_model_len: int = 2048,
    total_device_bytes: Optional[int] = None,
    used_device_bytes: Optional[int] = None,
    peak_activation_bytes: Optional[int] = None,
    free_ram_bytes: Optional[int] = None,
    groups: Optional[KVCacheGroups] = None,
    chunk_tokens: int = 1,
) -> int:
    """Number of KV blocks to allocate. Pure: every measurement comes in as an argument.

    Precedence:
      1. ``num_kv_blocks`` given: that many.
      2. ``kv_cache_memory`` (bytes) given: as many blocks as fit.
      3. GPU (``device`` "cuda"/"gpu"): ``gpu_memory_utilization * total_device_bytes -
         (used_device_bytes + peak_activation_bytes)``, where ``used_device_bytes`` is the
         non-KV memory in use (weights, workspace) and ``peak_activation_bytes`` the
         activation peak the engine measured with one profile forward.
      4. CPU (``gpu_memory_utilization`` does not apply): enough for ``max_num_seqs``
         sequences of ``min(max_model_len, CPU_EXPECTED_SEQ_TOKENS)`` tokens, capped at
         ``CPU_MAX_FREE_RAM_FRACTION`` of free RAM (read from /proc/meminfo when not
         given) and at ``CPU_MAX_KV_BYTES``.
    With hybrid ``groups`` a block is ``groups.group_size`` layers' worth
    (``KVCacheSpec.bytes_per_block_of``) and one request holds
    ``groups.blocks_per_request`` blocks, its sliding groups writing ``chunk_tokens`` per
    step at most (the step's token budget).
    Raises ValueError, with the numbers, when the result is under one block or cannot hold
    one request of ``max_model_len`` tokens.
    """
    if not spec.layers:  # no attention: blocks cost no memory and only count tokens
        if num_kv_blocks is not None:
            return _check_count(num_kv_blocks)
        return max_num_seqs * spec.blocks_for_tokens(max_model_len)
    groups = groups or KVCacheGroups.single(spec.num_layers)
    sizes = _BlockSizes(spec.bytes_per_block_of(groups), spec.block_size,
                        groups.blocks_per_request(max_model_len, spec.block_size, min(chunk_tokens, max_model_len)),
                        groups.blocks_per_request(min(max_model_len, CPU_EXPECTED_SEQ_TOKENS), spec.block_size))
    rule = kv_sizing_rule(num_kv_blocks, kv_cache_memory, device)
    if rule == "explicit count":
        return _check(_check_count(num_kv_blocks), sizes, max_model_len, f"num_kv_blocks={num_kv_blocks}")
    if rule == "byte budget":
        budget, source = int(kv_cache_memory), f"kv_cache_memory={kv_cache_memory} bytes"
    elif rule == "GPU profile":
        budget, source = _gpu_budget(gpu_memory_utilization, total_device_bytes, used_device_bytes,
                                     peak_activation_bytes)
    else:
        budget, source = _cpu_budget(sizes, max_num_seqs, max_model_len, free_ram_bytes)
    num_blocks = budget // sizes.bytes_per_block if budget > 0 else 0
    if num_blocks < 1:
        raise ValueError(f"KV budget too small for one block: {source} -> {budget} bytes < "
                         f"{sizes.bytes_per_block} bytes per block")
    return _check(num_blocks, sizes, max_model_len, source)


@dataclass(frozen=True)
class _BlockSizes:
    bytes_per_block: int
    block_size: int
    per_request: int  # blocks one request of max_model_len tokens holds
    per_default_seq: int  # blocks one request of the CPU default's length holds


def _check(num_blocks: int, sizes: _BlockSizes, max_model_len: int, source: str) -> int:
    need = sizes.per_request
    if num_blocks < need:
        raise ValueError(f"KV cache of {num_blocks} blocks ({source}) cannot hold one request of "
                         f"max_model_len={max_model_len} tokens: needs {need} blocks of "
                         f"{sizes.block_size} tokens ({need * sizes.bytes_per_block} bytes)")
    return num_blocks


def _gpu_budget(utilization, total, used, peak) -> tuple[int, str]:
    if utilization is None or not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    if total is None or used is None or peak is None:
        raise ValueError("GPU sizing needs total_device_bytes, used_device_bytes and peak_activation_bytes")
    budget = int(utilization * total) - (int(used) + int(peak))
    return budget, (f"gpu_memory_utilization={utilization} * total {total} - (used {used} + "
                    f"peak activation {peak}) bytes")


def _cpu_budget(sizes: _BlockSizes, max_num_seqs: int, max_model_len: int, free_ram) -> tuple[int, str]:
    free = free_ram_bytes_fn() if free_ram is None else int(free_ram)
    tokens = min(max_model_len, CPU_EXPECTED_SEQ_TOKENS)
    wanted = max_num_seqs * sizes.per_default_seq * sizes.bytes_per_block
    cap = min(int(free * CPU_MAX_FREE_RAM_FRACTION), CPU_MAX_KV_BYTES)
    return min(wanted, cap), (f"CPU default min({max_num_seqs} seqs x {tokens} tokens = {wanted}, "
                              f"{CPU_MAX_FREE_RAM_FRACTION} x free RAM {free}, {CPU_MAX_KV_BYTES}) bytes")


free_ram_bytes_fn = free_ram_bytes  # the parameter of determine_num_blocks shadows the name


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
        bs = self.spec.block_size
        return (self._zeros((self.num_blocks, bs, layer.k_heads, layer.k_head_dim)),
                self._zeros((self.num_blocks, bs, layer.v_heads, layer.v_head_dim)))

    def _zeros(self, shape: tuple) -> Any:
        if self.backend == "torch":
            return self._xp.zeros(shape, dtype=getattr(self._xp, self.spec.dtype))
        if self.spec.dtype == "bfloat16":
            raise ValueError(f"bfloat16 needs the torch backend ({self.backend} has no bfloat16)")
        return self._xp.zeros(shape, dtype=self.spec.dtype)

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
