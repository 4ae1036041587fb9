"""How the reference attention kernels read one K/V element: as stored, or dequantized.

``kv_loader(kv_format, head_dim)`` returns two device functions the kernels call in place of
indexing the caches:

* ``block_size_of(cache, heads)``: tokens per block. An unquantized cache ``[N, B, H, D]``
  says it (``B``); a quantized one ``[N, block_bytes]`` holds ``block_bytes / (heads *
  row_bytes)``.
* ``load(cache, blk, off, h, d, heads, block_size)``: element ``d`` of head ``h`` of the
  token at offset ``off`` of block ``blk``, as float32. A quantized element is decoded in
  registers from its code byte and its row's scale bytes (``KVFormat.block_regions``): the
  value ``kv_quant.dequantize_rows`` gives, with one exception: int4's ``code * scale + min``
  may be fused into one FMA (a difference of at most half an ulp of the result).

The kernels never see a dequantized copy of the cache. Both functions are compiled into each
kernel that calls them (the ``kv_format`` is a compile-time choice).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

from numba import cuda, float32, int32

from kvpage.core.kv_formats import KVFormat, int4_group

from .quant_math import fp8_codec, half_value


@cuda.jit(device=True, inline=True)
def _native_block_size(cache, heads):
    return int32(cache.shape[1])


@cuda.jit(device=True, inline=True)
def _native_load(cache, blk, off, h, d, heads, block_size):
    return float32(cache[blk, off, h, d])


@cuda.jit(device=True, inline=True)
def _half_at(cache, blk, at):
    """The float16 (little-endian) at byte ``at`` of block ``blk``, as float32."""
    return half_value(int32(cache[blk, at]) | (int32(cache[blk, at + 1]) << 8))


def _fp8_load(name: str, head_dim: int):
    decode = fp8_codec(name).decode
    D = head_dim

    @cuda.jit(device=True, inline=True)
    def load(cache, blk, off, h, d, heads, block_size):
        row = off * heads + h
        e = int32(cache[blk, block_size * heads * D + row])
        if e > 127:
            e -= 256  # a signed byte
        return decode(int32(cache[blk, row * D + d]), e)

    return load


def _int8_load(head_dim: int):
    D = head_dim

    @cuda.jit(device=True, inline=True)
    def load(cache, blk, off, h, d, heads, block_size):
        row = off * heads + h
        c = int32(cache[blk, row * D + d])
        if c > 127:
            c -= 256
        return float32(c) * _half_at(cache, blk, block_size * heads * D + row * 2)

    return load


def _int4_load(head_dim: int):
    G = int4_group(head_dim)
    CB, SB = head_dim // 2, 4 * (head_dim // G)

    @cuda.jit(device=True, inline=True)
    def load(cache, blk, off, h, d, heads, block_size):
        row = off * heads + h
        c = (int32(cache[blk, row * CB + d // 2]) >> ((d & 1) * 4)) & 15
        at = block_size * heads * CB + row * SB + (d // G) * 4
        return float32(c) * _half_at(cache, blk, at) + _half_at(cache, blk, at + 2)

    return load


@lru_cache(maxsize=None)
def kv_loader(kv_format: Optional[str], head_dim: int) -> tuple:
    """``(block_size_of, load)`` for caches of ``kv_format`` (None or an unquantized name:
    the values as stored, any float dtype) holding rows of ``head_dim`` values."""
    if kv_format is None or not KVFormat(kv_format).quantized:
        return _native_block_size, _native_load
    fmt = KVFormat(kv_format)
    fmt.check_head_dim(head_dim)
    row_bytes = fmt.row_bytes(head_dim)

    @cuda.jit(device=True, inline=True)
    def block_size_of(cache, heads):
        return int32(cache.shape[1] // (heads * row_bytes))

    if fmt.is_fp8:
        load = _fp8_load(fmt.name, head_dim)
    else:
        load = _int8_load(head_dim) if fmt.name == "int8" else _int4_load(head_dim)
    return block_size_of, load
