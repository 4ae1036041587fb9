"""Torch CPU paged attention: gather each sequence's blocks, then dense attention.

Contract: the one in :mod:`kvpage.attention` (same semantics as the numpy reference).
Inputs are torch tensors; index arrays may be numpy or torch.

Two paths:
  * decode (the leading sequences with query length 1): one batched gather of the block
    tables into ``[B, S_max, H_kv, D]`` (padded to the longest context) and one
    ``scaled_dot_product_attention`` call with the query heads grouped as
    ``[B, H_kv, group, D]`` so KV is never expanded for GQA/MQA; padding and the sliding
    window are a boolean mask.
  * prefill / chunked prefill (the rest): per sequence, gather ``[L, H_kv, D]`` and run
    SDPA with ``enable_gqa=True`` and a bottom-right aligned causal mask (queries are the
    last ``q_len`` positions of the context).
  Softcap, sinks and ALiBi are not SDPA features here: those calls take an explicit fp32
  path (matmul, tanh, position bias, mask, softmax with the sink in the denominator).

The gather copies the context once, so this path is several times slower than the
native and numba kernels at decode: it serves K/V of different shapes, chunked attention
and ALiBi, and is the fallback wherever those kernels cannot serve a layout.
Slots past a sequence's length are masked, not skipped: they must hold finite values
(true of a zero-initialized cache); the numba kernels never read them.

Quantized caches (``cache_format=`` a quantized :class:`~kvpage.core.kv_formats.CacheFormat`:
uint8 ``[num_blocks, block_bytes]`` buffers): stores quantize the rows, and attention is
:mod:`~kvpage.attention.tiled_torch`'s, which dequantizes each context's gathered rows and
computes every row alike however the step was scheduled.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from kvpage.attention.cpu_metadata import decodes_of
from kvpage.attention.reference import quantized
from kvpage.core.kv_formats import CacheFormat


def as_long(index) -> torch.Tensor:
    """An index array (numpy or torch) as a CPU int64 tensor (zero-copy when already one)."""
    if isinstance(index, torch.Tensor):
        return index.to(device="cpu", dtype=torch.int64)
    return torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))


def write_kv_torch(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping, cache_format: Optional[CacheFormat] = None) -> None:
    """Scatter ``k``/``v`` ``[T, H_kv, D]`` into flat slots ``slot_mapping`` ``[T]`` in place
    (a quantized cache: their codes and scales, :func:`quantized_torch.store_rows`)."""
    slots = as_long(slot_mapping)
    fmt = quantized(cache_format)
    if fmt is not None:
        from kvpage.attention.quantized_torch import store_rows

        store_rows(key_cache, k, slots, fmt)
        store_rows(value_cache, v, slots, fmt)
        return
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, k.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, v.to(value_cache.dtype))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` flattened to token rows: ``[..., n_blocks * block_size, H_kv, D]``."""
    # index_select on the flattened ids: measured ~4x faster than ``cache[block_ids]`` (2-D advanced indexing).
    rows = torch.index_select(cache, 0, block_ids.reshape(-1))
    return rows.view(*block_ids.shape[:-1], -1, *cache.shape[2:])


def _same_heads(k: torch.Tensor, v: torch.Tensor, num_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered ``k`` and ``v`` with one head count along ``dim``: unchanged when they agree
    (the usual case), else both repeated up to the ``num_heads`` query heads."""
    if k.shape[dim] == v.shape[dim]:
        return k, v
    return (k.repeat_interleave(num_heads // k.shape[dim], dim=dim),
            v.repeat_interleave(num_heads // v.shape[dim], dim=dim))


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, k_len: torch.Tensor, window: Optional[int],
             chunk: Optional[int] = None) -> torch.Tensor:
    """Boolean mask: key position ``k_pos`` visible from query position ``q_pos`` (within
    the sliding ``window`` and the attention ``chunk``, when given)."""
    ok = (k_pos <= q_pos) & (k_pos < k_len)
    if window:
        ok &= k_pos > q_pos - window
    if chunk:
        ok &= k_pos >= torch.div(q_pos, chunk, rounding_mode="floor") * chunk
    return ok


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask as 0 / -inf in ``dtype``: SDPA's CPU kernel runs ~1.5x faster with it."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))


def _attend_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float,
                 softcap: Optional[float], sinks: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Explicit fp32 attention ``q [..., M, D]`` x ``k, v [..., S, D]``, boolean ``mask`` [..., M, S].

    For softcap / sinks / ALiBi, which SDPA lacks. ``sinks`` broadcasts as ``[..., M, 1]``,
    ``bias`` (added after the softcap) as ``[..., M, S]``.
    """
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    weights = torch.softmax(scores, dim=-1)
    if sinks is not None:
        weights = weights[..., :-1]
    return torch.matmul(weights, v.float()).to(q.dtype)


def decode_torch(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, seq_lens: torch.Tensor,
                 block_tables: torch.Tensor, scaling: float, sliding_window: Optional[int] = None,
                 softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None, *,
                 attention_chunk: Optional[int] = None, alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Batched decode: ``q [B, H, D]`` (one row per sequence), int64 ``seq_lens [B]``, ``block_tables [B, *]``;
    returns ``[B, H, D_v]``."""
    num_seqs, num_heads, head_dim = q.shape
    block_size = key_cache.shape[1]
    max_blocks = -(-int(seq_lens.max()) // block_size)
    ids = block_tables[:, :max_blocks]
    k = _gather(key_cache, ids).transpose(1, 2)  # [B, H_kv, S, D] (a view of the gathered copy)
    v = _gather(value_cache, ids).transpose(1, 2)
    k, v = _same_heads(k, v, num_heads, dim=1)
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    k_pos = torch.arange(max_blocks * block_size).view(1, 1, 1, -1)
    lens = seq_lens.view(-1, 1, 1, 1)
    mask = _allowed(lens - 1, k_pos, lens, sliding_window, attention_chunk)  # [B, 1, 1, S]
    sink = None if sinks is None else sinks.view(1, num_kv_heads, group, 1)
    qg = q.view(num_seqs, num_kv_heads, group, head_dim)
    if softcap or sinks is not None or alibi_slopes is not None:
        bias = None if alibi_slopes is None else alibi_slopes.float().view(1, num_kv_heads, group, 1) * k_pos
        out = _attend_math(qg, k, v, mask, scaling, softcap, sink, bias)
    else:
        full = not sliding_window and not attention_chunk and bool((seq_lens == max_blocks * block_size).all())
        attn_mask = None if full else _additive(mask, q.dtype)  # nothing to mask: let SDPA skip it
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=attn_mask, scale=scaling)
    return out.reshape(num_seqs, num_heads, v.shape[-1])


def prefill_one_torch(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, seq_len: int,
                      block_ids: torch.Tensor, scaling: float, sliding_window: Optional[int] = None,
                      softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None, *,
                      attention_chunk: Optional[int] = None, alibi_slopes: Optional[torch.Tensor] = None
                      ) -> torch.Tensor:
    """One sequence: ``q [Q, H, D]`` are the last ``Q`` positions of a ``seq_len``-token context;
    returns ``[Q, H, D_v]``."""
    q_len, num_heads, head_dim = q.shape
    block_size = key_cache.shape[1]
    ids = block_ids[: -(-seq_len // block_size)]
    k = _gather(key_cache, ids)[:seq_len].transpose(0, 1)  # [H_kv, L, D]
    v = _gather(value_cache, ids)[:seq_len].transpose(0, 1)
    k, v = _same_heads(k, v, num_heads, dim=0)
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    if not softcap and sinks is None and alibi_slopes is None:
        # 4-D with enable_gqa takes SDPA's blocked CPU kernel (3-D / grouped rows fall back to
        # a ~5x slower path); is_causal is top-left aligned, right only when q_len == seq_len.
        causal = q_len == seq_len and not sliding_window and not attention_chunk
        mask = None if causal else _additive(_prefill_mask(q_len, seq_len, sliding_window, attention_chunk), q.dtype)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                             is_causal=causal, scale=scaling, enable_gqa=True)
        return out[0].transpose(0, 1)
    # Query heads grouped per KV head: [H_kv, group * Q, D] rows (g, t), KV never expanded.
    qg = q.permute(1, 0, 2).reshape(num_kv_heads, group * q_len, head_dim)
    sink = None if sinks is None else sinks.view(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, 1).reshape(
        num_kv_heads, group * q_len, 1)
    mask = _prefill_mask(q_len, seq_len, sliding_window, attention_chunk).repeat(group, 1)
    bias = None if alibi_slopes is None else (alibi_slopes.float().view(num_kv_heads, group, 1, 1)
                                              * torch.arange(seq_len, dtype=torch.float32)).expand(
        -1, -1, q_len, -1).reshape(num_kv_heads, group * q_len, seq_len)
    out = _attend_math(qg, k, v, mask, scaling, softcap, sink, bias)  # [H_kv, group * Q, D_v]
    return out.reshape(num_heads, q_len, v.shape[-1]).transpose(0, 1)


def _prefill_mask(q_len: int, seq_len: int, sliding_window: Optional[int],
                  attention_chunk: Optional[int] = None) -> torch.Tensor:
    """``[q_len, seq_len]`` boolean mask for the last ``q_len`` positions of the context."""
    q_pos = torch.arange(seq_len - q_len, seq_len).view(-1, 1)
    return _allowed(q_pos, torch.arange(seq_len).view(1, -1), torch.tensor(seq_len), sliding_window, attention_chunk)


def paged_attention_torch(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc,
    seq_lens,
    block_tables,
    scaling: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    *,
    num_decodes: Optional[int] = None,
    attention_chunk: Optional[int] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    cache_format: Optional[CacheFormat] = None,
) -> torch.Tensor:
    """The contract's ``paged_attention`` on torch CPU tensors; returns ``[T, H, D_v]`` in ``q``'s dtype.

    K and V may differ in head size (``D_v``, MLA) and in head count. ``num_decodes``
    leading sequences (default: the leading run of query length 1) take the batched decode
    path; the rest go one sequence at a time (a loop over sequences, never over tokens).
    A quantized ``cache_format`` is refused: :func:`tiled_torch.paged_attention_tiled` reads those.
    """
    if quantized(cache_format) is not None:
        raise ValueError("quantized KV caches take kvpage.attention.tiled_torch.paged_attention_tiled")
    for cache in (key_cache, value_cache):
        if q.shape[1] % cache.shape[2]:
            raise ValueError(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({cache.shape[2]})")
    if q.shape[2] != key_cache.shape[3]:
        raise ValueError(f"head_dim mismatch: q has {q.shape[2]}, the key cache {key_cache.shape[3]}")
    qsl, lens, tables = as_long(query_start_loc), as_long(seq_lens), as_long(block_tables)
    sinks_t = None if sinks is None else torch.as_tensor(sinks, dtype=torch.float32)
    num_decodes = decodes_of(qsl.numpy(), num_decodes)
    out = q.new_empty((*q.shape[:2], value_cache.shape[3]))
    if num_decodes:
        out[:num_decodes] = decode_torch(q[:num_decodes], key_cache, value_cache, lens[:num_decodes],
                                         tables[:num_decodes], scaling, sliding_window, softcap, sinks_t,
                                         attention_chunk=attention_chunk, alibi_slopes=alibi_slopes)
    bounds = qsl.tolist()
    for i, seq_len in enumerate(lens.tolist()[num_decodes:], start=num_decodes):
        start, end = bounds[i], bounds[i + 1]
        if end > start:
            out[start:end] = prefill_one_torch(q[start:end], key_cache, value_cache, seq_len, tables[i], scaling,
                                               sliding_window, softcap, sinks_t, attention_chunk=attention_chunk,
                                               alibi_slopes=alibi_slopes)
    return out


def selected_attention_torch(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, query_start_loc,
                             seq_lens, block_tables, key_selection: torch.Tensor, scaling: float,
                             softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sparse paged attention (DeepSeek's DSA): query row ``t`` attends only the key
    positions ``key_selection[t]`` lists (int ``[T, K]``, -1 for none), within causality.
    Otherwise as ``paged_attention_torch`` (queries are the last positions of each
    context); explicit fp32 math, one sequence at a time. Returns ``[T, H, D_v]``."""
    qsl, lens, tables = as_long(query_start_loc), as_long(seq_lens), as_long(block_tables)
    sinks_t = None if sinks is None else torch.as_tensor(sinks, dtype=torch.float32)
    selection = key_selection.to(device="cpu", dtype=torch.int64)
    num_heads = q.shape[1]
    block_size = key_cache.shape[1]
    out = q.new_empty((*q.shape[:2], value_cache.shape[3]))
    bounds = qsl.tolist()
    for i, seq_len in enumerate(lens.tolist()):
        start, end = bounds[i], bounds[i + 1]
        q_len = end - start
        if not q_len:
            continue
        ids = tables[i][: -(-seq_len // block_size)]
        k = _gather(key_cache, ids)[:seq_len].transpose(0, 1)  # [H_kv, L, D]
        v = _gather(value_cache, ids)[:seq_len].transpose(0, 1)
        k, v = _same_heads(k, v, num_heads, dim=0)
        group = num_heads // k.shape[0]
        picked = selection[start:end]
        # Column seq_len collects the -1 entries (and any past the context); it is cut off again.
        chosen = torch.zeros((q_len, seq_len + 1), dtype=torch.bool)
        chosen.scatter_(1, torch.where((picked < 0) | (picked >= seq_len), seq_len, picked), True)
        mask = chosen[:, :seq_len] & _prefill_mask(q_len, seq_len, None)
        qg = q[start:end].permute(1, 0, 2).reshape(k.shape[0], group * q_len, q.shape[2])
        sink = None if sinks_t is None else sinks_t.view(k.shape[0], group, 1, 1).expand(-1, -1, q_len, 1).reshape(
            k.shape[0], group * q_len, 1)
        attended = _attend_math(qg, k, v, mask.repeat(group, 1), scaling, softcap, sink)
        out[start:end] = attended.reshape(num_heads, q_len, v.shape[-1]).transpose(0, 1)
    return out
