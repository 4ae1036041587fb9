"""Torch paged attention whose every output row is independent of how the step was scheduled.

Used over quantized caches (:mod:`~kvpage.attention.quantized_torch` reads their rows):
there, attention reads K/V only from the cache, and a token's stored bytes depend only on
the token, so a query row sees the same inputs whether its prompt was prefilled whole, in
chunks, from a prefix hit or after preemption. This module makes the arithmetic the same
too: a library kernel's result for one row can depend on the shapes it is called with
(SDPA and GEMMs block their loops by the number of query rows and keys), so every call here
has shapes that depend only on the row's absolute position, never on the step.

The query positions of a sequence are cut into *tiles* of :data:`TILE` positions aligned to
absolute position (tile ``t`` is positions ``[t * TILE, (t + 1) * TILE)``). A tile is
attended in one call: its ``TILE`` query rows (rows of positions outside the step are zero
and their outputs dropped) against keys ``[lo, (t + 1) * TILE)``, where ``lo`` (0, or the
first tile-aligned position the sliding window or attention chunk can see) depends only on
``t``. Keys past the context are zero; causality masks them, as it masks every key after a
query's own position, so a masked key's value never matters (its weight is exactly 0). A
decode row is a tile like any other: each sequence is its own call (a loop over sequences
and tiles, never over tokens).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kvpage.attention import torch_cpu
from kvpage.attention.quantized_torch import gather_rows
from kvpage.attention.reference import check_same_rows
from kvpage.core.kv_formats import CacheFormat

#: Query positions per tile: a decode row costs a tile's work (16 rows against its keys).
TILE = 16


def paged_attention_tiled(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, query_start_loc,
                          seq_lens, block_tables, scaling: float, sliding_window: Optional[int] = None,
                          softcap: Optional[float] = None, sinks=None, *, cache_format: CacheFormat,
                          seqs: Optional[range] = None, out: Optional[torch.Tensor] = None,
                          attention_chunk: Optional[int] = None,
                          alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The contract's ``paged_attention`` over quantized buffers of ``cache_format`` (K and V
    of one shape), rows of the sequences ``seqs`` (default all) into ``out`` (``[T, H, D]``
    of q's dtype, allocated when None; other rows left alone). Returns ``out``."""
    check_same_rows(key_cache.shape, value_cache.shape, cache_format)
    kv_heads = cache_format.logical_shape(tuple(key_cache.shape), int(q.shape[2]))[2]
    if q.shape[1] % kv_heads:
        raise ValueError(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({kv_heads})")
    qsl, lens, tables = (torch_cpu.as_long(a) for a in (query_start_loc, seq_lens, block_tables))
    out = q.new_empty(q.shape) if out is None else out
    sinks_t = None if sinks is None else torch.as_tensor(sinks, dtype=torch.float32)
    slopes = None if alibi_slopes is None else torch.as_tensor(alibi_slopes, dtype=torch.float32)
    call = _Call(scaling, sliding_window, softcap, sinks_t, attention_chunk, slopes)
    bounds, seq_lens_list = qsl.tolist(), lens.tolist()
    for i in seqs if seqs is not None else range(len(seq_lens_list)):
        start, end = bounds[i], bounds[i + 1]
        if end > start:
            out[start:end] = _attend_sequence(q[start:end], key_cache, value_cache, seq_lens_list[i], tables[i],
                                              cache_format, call)
    return out


class _Call:
    """One call's attention arguments (sinks and ALiBi slopes as float32 tensors)."""

    __slots__ = ("scaling", "window", "softcap", "sinks", "chunk", "slopes")

    def __init__(self, scaling, window, softcap, sinks, chunk, slopes) -> None:
        self.scaling, self.window, self.softcap = scaling, window or None, softcap or None
        self.sinks, self.chunk, self.slopes = sinks, chunk or None, slopes

    def first_visible(self, position: int) -> int:
        """The first key position a query at ``position`` sees."""
        lo = 0
        if self.window:
            lo = max(lo, position - self.window + 1)
        if self.chunk:
            lo = max(lo, position // self.chunk * self.chunk)
        return lo

    def first_key(self, tile_start: int) -> int:
        """The first key position tile ``[tile_start, tile_start + TILE)`` reads, tile-aligned."""
        return self.first_visible(tile_start) // TILE * TILE


def _attend_sequence(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, seq_len: int,
                     table: torch.Tensor, cache_format: CacheFormat, call: _Call) -> torch.Tensor:
    """``q [Q, H, D]``, the last ``Q`` positions of a ``seq_len``-token context: ``[Q, H, D]``."""
    q_len, num_heads, head_dim = q.shape
    first = seq_len - q_len
    tile_lo, tile_hi = first // TILE, (seq_len - 1) // TILE + 1
    # Keys [key_lo, key_end) cover every tile's; of them only [visible, seq_len) can carry
    # weight (the rest stay zero: blocks behind a window may be padding, with any bytes).
    key_lo, key_end = call.first_key(tile_lo * TILE), tile_hi * TILE
    visible = call.first_visible(first)
    block_size = cache_format.block_size
    block_lo = visible // block_size
    ids = table[block_lo: -(-seq_len // block_size)]
    # float32 throughout, as the oracle and the native kernels: the dequantized values are
    # exact in float32, and rounding them to a 16-bit q's dtype would add an error the
    # format does not have (large keys make it a large score error).
    keys, values = (_window(gather_rows(cache, ids, cache_format, head_dim, torch.float32), block_lo * block_size,
                            visible, seq_len, key_lo, key_end) for cache in (key_cache, value_cache))
    queries = q.new_zeros(((tile_hi - tile_lo) * TILE, num_heads, head_dim), dtype=torch.float32)
    offset = first - tile_lo * TILE
    queries[offset:offset + q_len] = q
    out = queries.new_empty(queries.shape)
    for t in range(tile_lo, tile_hi):
        lo, hi = call.first_key(t * TILE), (t + 1) * TILE
        rows = slice((t - tile_lo) * TILE, (t - tile_lo + 1) * TILE)
        out[rows] = _attend_tile(queries[rows], keys[lo - key_lo:hi - key_lo], values[lo - key_lo:hi - key_lo],
                                 t * TILE, lo, call)
    return out[offset:offset + q_len].to(q.dtype)


def _window(rows: torch.Tensor, rows_start: int, visible: int, seq_len: int, key_lo: int,
            key_end: int) -> torch.Tensor:
    """Keys (or values) of positions ``[key_lo, key_end)``: ``rows`` (positions from
    ``rows_start``) at ``[visible, seq_len)``, zero elsewhere."""
    keys = rows.new_zeros((key_end - key_lo, *rows.shape[1:]))
    keys[visible - key_lo:seq_len - key_lo] = rows[visible - rows_start:seq_len - rows_start]
    return keys


def _attend_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int,
                 call: _Call) -> torch.Tensor:
    """One tile: ``q [TILE, H, D]`` at positions ``q_start..``, keys ``k, v [N, H_kv, D]`` at
    positions ``k_start..``; every shape and mask here depends only on the tile's position."""
    tile, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    q_pos = torch.arange(q_start, q_start + tile).view(-1, 1)
    k_pos = torch.arange(k_start, k_start + k.shape[0]).view(1, -1)
    mask = torch_cpu._allowed(q_pos, k_pos, torch.tensor(k_start + k.shape[0]), call.window, call.chunk)
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [H_kv, N, D]
    if not call.softcap and call.sinks is None and call.slopes is None:
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                             attn_mask=torch_cpu._additive(mask, q.dtype), scale=call.scaling,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)
    # Query heads grouped per KV head: [H_kv, group * TILE, D] rows (g, t), KV never expanded.
    qg = q.permute(1, 0, 2).reshape(num_kv_heads, group * tile, head_dim)
    sink = None if call.sinks is None else call.sinks.view(num_kv_heads, group, 1, 1).expand(
        -1, -1, tile, 1).reshape(num_kv_heads, group * tile, 1)
    bias = None if call.slopes is None else (call.slopes.view(num_kv_heads, group, 1, 1) * k_pos.float()).expand(
        -1, -1, tile, -1).reshape(num_kv_heads, group * tile, -1)
    out = torch_cpu._attend_math(qg, k, v, mask.repeat(group, 1), call.scaling, call.softcap, sink, bias)
    return out.reshape(num_heads, tile, head_dim).transpose(0, 1)
