"""Numba CUDA kernel that scatters a step's new K/V rows into the paged caches.

Built lazily (``store_kernel()``), so importing this module compiles nothing.
"""
from __future__ import annotations

from functools import lru_cache

# Module-level so the simulator can swap ``cuda`` in the kernels' globals; this module is
# imported only by the launch wrappers, never by ``kvpage.cuda`` itself.
from numba import cuda, int64


@lru_cache(maxsize=None)
def store_kernel():
    """``kernel(key_cache, value_cache, k, v, slot_mapping)``, a 1-D grid over ``T * H_kv * D``.

    Element ``(t, h, d)`` of ``k``/``v`` goes to slot ``slot_mapping[t]``
    (``block = slot // block_size``, ``offset = slot % block_size``). Negative slots are
    padding and are skipped. Consecutive threads handle consecutive ``d``, so both the
    read and the write of one token row are coalesced.
    """
    @cuda.jit
    def kernel(key_cache, value_cache, k, v, slot_mapping):
        num_tokens, num_kv_heads, head_dim = k.shape
        block_size = key_cache.shape[1]
        row = num_kv_heads * head_dim
        total = num_tokens * row
        i = int64(cuda.grid(1))
        step = int64(cuda.gridsize(1))
        while i < total:
            t = i // row
            rem = i % row
            h = rem // head_dim
            d = rem % head_dim
            slot = int64(slot_mapping[t])
            if slot >= 0:
                blk = slot // block_size
                off = slot % block_size
                key_cache[blk, off, h, d] = k[t, h, d]
                value_cache[blk, off, h, d] = v[t, h, d]
            i += step

    return kernel
