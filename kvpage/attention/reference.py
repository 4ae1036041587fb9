"""Plain numpy paged attention: slow, obvious, and the oracle for every other backend.

Semantics shared by all backends (positions are absolute within a sequence):
  * query at position p attends to key positions j with j <= p;
  * with ``sliding_window`` W, also j > p - W (the window includes the query itself,
    as in transformers' masks);
  * with ``attention_chunk`` C (Llama 4's chunked attention), also j >= (p // C) * C:
    a query sees only its own chunk of C positions;
  * with ``alibi_slopes`` (one per query head, ALiBi: Bloom, MPT) head h's score for key
    position j gains ``slopes[h] * j`` (the same as ``slopes[h] * (j - p)``, since a softmax
    row ignores a constant);
  * scores are ``q . k * scaling``; with ``softcap`` c they become ``c * tanh(score / c)``;
  * with ``sinks`` (one logit per query head) the softmax denominator gains
    ``exp(sink)``, and the sink contributes no value (gpt-oss);
  * query head h reads KV head ``h // (num_heads // num_kv_heads)`` (GQA/MQA), where K
    and V may differ in head count and V in head size ``D_v`` (MLA models): the output is
    ``[T, num_heads, D_v]``.
Accumulation is in float32; the output has ``q``'s dtype.

Quantized caches (``cache_format`` a quantized :class:`~kvpage.core.kv_formats.CacheFormat`)
are uint8 ``[num_blocks, block_bytes]`` buffers: :func:`write_kv_reference` stores the rows'
codes and scales (:func:`kvpage.kernels.kv_quant.quantize_rows`, the definition of the bytes)
and :func:`paged_attention_reference` dequantizes each sequence's gathered rows (never the
whole cache), head size from ``q``. K and V of different shapes (MLA) take no quantized format.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kvpage.core.kv_formats import CacheFormat
from kvpage.kernels import kv_quant


def quantized(cache_format: Optional[CacheFormat]) -> Optional[CacheFormat]:
    """``cache_format`` where it is a quantized one, else None (an unquantized format's
    buffers are plain ``[num_blocks, block_size, H_kv, D]`` values)."""
    return cache_format if cache_format is not None and cache_format.quantized else None


def check_same_rows(key_shape: tuple, value_shape: tuple, cache_format: CacheFormat) -> None:
    """Raise ``ValueError`` where quantized K and V buffers differ in shape (MLA)."""
    if tuple(key_shape) != tuple(value_shape):
        raise ValueError(f"kv_cache_dtype {cache_format.kv_format.name} needs K and V of one shape; these "
                         f"buffers are {tuple(key_shape)} and {tuple(value_shape)} (MLA: use an unquantized KV cache)")


def write_kv_reference(key_cache: np.ndarray, value_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
                       slot_mapping: np.ndarray, cache_format: Optional[CacheFormat] = None) -> None:
    """Scatter ``k``/``v`` ``[T, H_kv, D]`` into the caches at ``slot_mapping`` ``[T]`` (a
    quantized cache: their codes and scales)."""
    slots = np.asarray(slot_mapping, dtype=np.int64)
    fmt = quantized(cache_format)
    for cache, rows in ((key_cache, k), (value_cache, v)):
        if fmt is None:
            num_blocks, block_size = cache.shape[:2]
            cache.reshape(num_blocks * block_size, *cache.shape[2:])[slots] = rows
            continue
        rows = np.asarray(rows, dtype=np.float32)
        heads, head_dim = rows.shape[1:]
        cache_heads = fmt.logical_shape(cache.shape, head_dim)[2]
        if cache_heads != heads:
            raise ValueError(f"K/V rows of {heads} heads do not fit a {fmt.kv_format.name} cache of {cache_heads} heads")
        codes, scales = kv_quant.quantize_rows(rows, fmt.kv_format)
        code_view, scale_view = kv_quant.block_views(cache, fmt.kv_format, fmt.block_size, heads, head_dim)
        block, offset = slots // fmt.block_size, slots % fmt.block_size
        code_view[block, offset] = codes
        scale_view[block, offset] = scales


def gather_context(cache: np.ndarray, block_table: np.ndarray, seq_len: int) -> np.ndarray:
    """The first ``seq_len`` token rows of one sequence, ``[seq_len, H_kv, D]``."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    rows = cache[np.asarray(block_table[:num_blocks], dtype=np.int64)]
    return rows.reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


class _Rows:
    """How one buffer's token rows are read back as float32: as they are, or (quantized) the
    block views of its codes and scales, dequantized per gathered sequence."""

    def __init__(self, cache: np.ndarray, fmt: Optional[CacheFormat], head_dim: int) -> None:
        self.cache, self.fmt = cache, fmt
        if fmt is None:
            self.heads, self.head_dim = cache.shape[2], cache.shape[3]
        else:
            self.heads, self.head_dim = fmt.logical_shape(cache.shape, head_dim)[2:]
            self.views = kv_quant.block_views(cache, fmt.kv_format, fmt.block_size, self.heads, head_dim)

    def context(self, block_table: np.ndarray, seq_len: int) -> np.ndarray:
        """``[seq_len, H_kv, D]`` float32: the first ``seq_len`` rows of one sequence."""
        if self.fmt is None:
            return gather_context(self.cache, block_table, seq_len).astype(np.float32)
        codes, scales = (gather_context(view, block_table, seq_len) for view in self.views)
        return kv_quant.dequantize_rows(codes, scales, self.fmt.kv_format)


def paged_attention_reference(
    q: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    scaling: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[np.ndarray] = None,
    attention_chunk: Optional[int] = None,
    alibi_slopes: Optional[np.ndarray] = None,
    cache_format: Optional[CacheFormat] = None,
) -> np.ndarray:
    """The contract's ``paged_attention`` by the semantics above; ``[T, H, D_v]`` in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    fmt = quantized(cache_format)
    if fmt is not None:
        check_same_rows(key_cache.shape, value_cache.shape, fmt)
    key_rows, value_rows = _Rows(key_cache, fmt, head_dim), _Rows(value_cache, fmt, head_dim)
    for rows in (key_rows, value_rows):
        if num_heads % rows.heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({rows.heads})")
    k_group, v_group = num_heads // key_rows.heads, num_heads // value_rows.heads
    out = np.zeros((num_tokens, num_heads, value_rows.head_dim), dtype=np.float32)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    for i, seq_len in enumerate(np.asarray(seq_lens, dtype=np.int64).tolist()):
        start, end = int(qsl[i]), int(qsl[i + 1])
        if end == start:
            continue
        keys = key_rows.context(block_tables[i], seq_len)
        values = value_rows.context(block_tables[i], seq_len)
        keys = np.repeat(keys, k_group, axis=1)  # [S, H, D]
        values = np.repeat(values, v_group, axis=1)  # [S, H, D_v]
        queries = q[start:end].astype(np.float32)  # [Q, H, D]
        scores = np.einsum("qhd,shd->hqs", queries, keys) * np.float32(scaling)
        if softcap:
            scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
        if alibi_slopes is not None:
            slopes = np.asarray(alibi_slopes, dtype=np.float32).reshape(num_heads, 1, 1)
            scores = scores + slopes * np.arange(seq_len, dtype=np.float32)[None, None, :]
        allowed = _allowed(end - start, seq_len, sliding_window, attention_chunk)
        weights = _softmax_with_sinks(np.where(allowed[None], scores, -np.inf), sinks, num_heads)
        out[start:end] = np.einsum("hqs,shd->qhd", weights, values)
    return out.astype(q.dtype)


def _allowed(q_len: int, seq_len: int, sliding_window: Optional[int], attention_chunk: Optional[int]) -> np.ndarray:
    """``[q_len, seq_len]``: key position j visible from each of the last ``q_len`` positions."""
    q_pos = np.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = np.arange(seq_len)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window:
        allowed &= k_pos > q_pos - sliding_window
    if attention_chunk:
        allowed &= k_pos >= q_pos // attention_chunk * attention_chunk
    return allowed


def _softmax_with_sinks(scores: np.ndarray, sinks: Optional[np.ndarray], num_heads: int) -> np.ndarray:
    """Softmax over the last axis of ``scores`` ``[H, Q, S]``; a head's sink adds ``exp(sink)``
    to its denominator only."""
    row_max = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float32).reshape(num_heads, 1, 1)
        row_max = np.maximum(row_max, sink)
    weights = np.exp(scores - row_max)
    denom = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(sink - row_max)
    return weights / denom
