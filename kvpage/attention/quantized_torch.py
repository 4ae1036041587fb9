"""Quantized K/V caches in torch: read a context's rows back as values, store new rows as bytes.

A quantized layer buffer is uint8 ``[num_blocks, block_bytes]`` (:mod:`kvpage.core.kv_formats`):
per block the codes of its token rows, then their scales. The torch attention path
(:mod:`~kvpage.attention.torch_cpu`) gathers a context's blocks as bytes and dequantizes
only those rows (:func:`gather_rows`), never the whole cache. The arithmetic mirrors
:func:`kvpage.kernels.kv_quant.dequantize_rows` operation for operation (float32, the same
products and sums, no fused multiply-add), so the values are bit-identical to the numpy
reference's.

Stores (:func:`store_rows`) quantize with the numpy reference encoder
(:func:`kvpage.kernels.kv_quant.quantize_rows`, the definition of the bytes) and scatter the
bytes with torch, on the buffer's device: the fallback where the native store is unavailable.
"""
from __future__ import annotations

import torch

from kvpage.core.kv_formats import CacheFormat, KVFormat, int4_group
from kvpage.kernels import kv_quant

_FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def dequantize_rows_torch(codes: torch.Tensor, scales: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """The float32 ``[..., D]`` values of uint8 rows ``codes [..., code_bytes]`` and ``scales
    [..., scale_bytes]`` (contiguous): :func:`kv_quant.dequantize_rows` in torch."""
    if fmt.is_fp8:
        # torch's fp8 dtypes are the formats' codes (E4M3 "fn": no infinities, one NaN).
        values = codes.view(_FP8_DTYPES[fmt.name]).to(torch.float32)
        return torch.ldexp(values, scales.view(torch.int8).to(torch.float32))  # exact: a power of two
    if fmt.name == "int8":
        return codes.view(torch.int8).to(torch.float32) * scales.view(torch.float16).to(torch.float32)
    head_dim = 2 * codes.shape[-1]
    group = int4_group(head_dim)
    nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).to(torch.float32)
    nibbles = nibbles.view(*codes.shape[:-1], head_dim // group, group)
    params = scales.view(torch.float16).to(torch.float32)  # [..., 2 * groups]: (scale, min) per group
    scale, low = params[..., 0::2, None], params[..., 1::2, None]
    return (nibbles * scale + low).view(*codes.shape[:-1], head_dim)


def gather_rows(cache: torch.Tensor, block_ids: torch.Tensor, cache_format: CacheFormat, head_dim: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The token rows of blocks ``block_ids`` (int64 ``[..., n]``) of a quantized buffer, as
    ``[..., n * block_size, H_kv, head_dim]`` values of ``dtype``: the blocks' bytes are
    gathered, then only those rows dequantized."""
    fmt, block_size = cache_format.kv_format, cache_format.block_size
    heads = cache_format.logical_shape(tuple(cache.shape), head_dim)[2]
    flat = block_ids.reshape(-1)
    blocks = torch.index_select(cache, 0, flat)  # [n, block_bytes]: one copy of the context's bytes
    codes, scales = kv_quant.block_views(blocks, fmt, block_size, heads, head_dim)
    values = dequantize_rows_torch(codes.contiguous(), scales.contiguous(), fmt)  # [n, bs, H, D] float32
    return values.to(dtype).view(*block_ids.shape[:-1], -1, heads, head_dim)


def store_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, cache_format: CacheFormat) -> None:
    """Quantize ``rows`` ``[T, H_kv, D]`` (as float32) and write their bytes to flat slots
    ``slots`` (int64 ``[T]``, on any device) of the uint8 buffer ``cache``, in place.

    Raises ``IndexError`` before writing anything for a slot outside the cache.
    """
    fmt, block_size = cache_format.kv_format, cache_format.block_size
    num_blocks, _, heads, head_dim = cache_format.logical_shape(tuple(cache.shape), int(rows.shape[2]))
    if int(rows.shape[1]) != heads:
        raise ValueError(f"K/V rows of {rows.shape[1]} heads do not fit a cache of {heads} heads")
    slots = slots.to(device=cache.device, dtype=torch.int64)
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_blocks * block_size):
        raise IndexError(f"a KV slot outside the cache ({num_blocks * block_size} slots)")
    codes, scales = kv_quant.quantize_rows(rows.detach().to("cpu", torch.float32).numpy(), fmt)
    code_view, scale_view = kv_quant.block_views(cache, fmt, block_size, heads, head_dim)
    block, offset = torch.div(slots, block_size, rounding_mode="floor"), slots % block_size
    code_view[block, offset] = torch.from_numpy(codes).to(cache.device)
    scale_view[block, offset] = torch.from_numpy(scales).to(cache.device)
