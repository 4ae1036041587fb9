"""The launch side of quantized KV caches: argument checks, the store launch, the decode choice.

A quantized cache (``cache_format`` a quantized ``kvpage.core.kv_formats.CacheFormat``) is a
uint8 buffer ``[num_blocks, block_bytes]`` per layer and K/V (``KVFormat.buffer_shape``);
its logical shape ``[num_blocks, block_size, H_kv, head_dim]`` follows from the format, the
block size and the head size (``CacheFormat.logical_shape``). ``store_kv`` quantizes rows into
it (``quant_store``); ``paged_attention`` reads it through the reference kernels, which
dequantize each element as they load it (``quant_load``). int8/fp8 decodes with float16 q take
the fast kernel (``fast_dispatch``, ``fast_rows``); int4 stays on the reference kernels.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kvpage.core.kv_formats import CacheFormat

from .fast_dispatch import dtype_name
from .interop import as_kernel_arg, simulator_enabled
from .launch_args import meta_arg

#: Dtypes of the K/V rows ``store_kv`` quantizes, and of ``q`` over a quantized cache.
ROW_DTYPES = ("float16", "float32")


def quantized(cache_format: Optional[CacheFormat]) -> Optional[CacheFormat]:
    """``cache_format`` where it is a quantized one, else None (unquantized: caches of values)."""
    if cache_format is None:
        return None
    if not isinstance(cache_format, CacheFormat):
        raise ValueError("cache_format must be a kvpage.core.kv_formats.CacheFormat, got "
                         f"{type(cache_format).__name__}")
    return cache_format if cache_format.quantized else None


def logical_shape(key_cache: Any, value_cache: Any, head_dim: int, fmt: CacheFormat) -> tuple:
    """``(num_blocks, block_size, H_kv, head_dim)`` of two quantized caches (ValueError if they
    are not equal uint8 ``[num_blocks, block_bytes]`` buffers of ``fmt``)."""
    shapes = (tuple(key_cache.shape), tuple(value_cache.shape))
    if len(shapes[0]) != 2 or shapes[0] != shapes[1]:
        raise ValueError(f"{fmt.kv_format.name} caches must be two equal [num_blocks, block_bytes] buffers, got "
                         f"{shapes[0]} and {shapes[1]}")
    for name, arr in (("key_cache", key_cache), ("value_cache", value_cache)):
        if dtype_name(arr) != "uint8":
            raise ValueError(f"{name} must be uint8 bytes for kv_cache_dtype {fmt.kv_format.name}, got "
                             f"{dtype_name(arr)}")
    return fmt.logical_shape(shapes[0], head_dim)


def check_rows(name: str, x: Any) -> None:
    """``x`` (q, k or v over a quantized cache) must be float16 or float32."""
    if dtype_name(x) not in ROW_DTYPES:
        raise ValueError(f"{name} must be float16 or float32 over a quantized KV cache (the reference kernels "
                         f"read these), got {dtype_name(x)}")


def store_quantized(key_cache: Any, value_cache: Any, k: Any, v: Any, slot_mapping: Any, fmt: CacheFormat,
                    stream: Any, threads: int) -> None:
    """Quantize ``k``/``v`` ``[T, H_kv, D]`` into the quantized caches at ``slot_mapping``
    (``ops.store_kv``'s contract; the kernel is launched on ``stream``, a Numba stream)."""
    if len(k.shape) != 3 or tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k/v must be two equal [T, H_kv, D] arrays, got {tuple(k.shape)} and {tuple(v.shape)}")
    num_tokens, heads, head_dim = (int(s) for s in k.shape)
    num_blocks, block_size, cache_heads, _ = logical_shape(key_cache, value_cache, head_dim, fmt)
    if heads != cache_heads:
        raise ValueError(f"k/v rows of {heads} heads do not fit a {fmt.kv_format.name} cache of {cache_heads} heads")
    for name, arr in (("k", k), ("v", v)):
        check_rows(name, arr)
    if tuple(slot_mapping.shape) != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    capacity = num_blocks * block_size
    if isinstance(slot_mapping, np.ndarray) and slot_mapping.size and int(np.max(slot_mapping)) >= capacity:
        raise ValueError(f"slot_mapping has a slot >= num_blocks * block_size ({num_blocks * block_size})")
    for name, arr in (("key_cache", key_cache), ("value_cache", value_cache)):
        if isinstance(arr, np.ndarray) and not simulator_enabled():
            raise ValueError(f"{name} must be a device array: store_kv writes it in place")
    rows = num_tokens * heads
    if rows == 0 or head_dim == 0:
        return
    from .quant_store import quant_store_kernel  # numba.cuda loads here, after validation

    args = [as_kernel_arg(a, stream) for a in (key_cache, value_cache, k, v)]
    blocks = min(-(-rows // threads), 1 << 20)
    quant_store_kernel(fmt.kv_format.name, head_dim)[blocks, threads, stream](
        *args, meta_arg(slot_mapping, np.int64, stream), block_size)
