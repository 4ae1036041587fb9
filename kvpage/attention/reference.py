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
"""
from __future__ import annotations

from typing import Optional

import numpy as np


def write_kv_reference(key_cache: np.ndarray, value_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
                       slot_mapping: np.ndarray) -> None:
    """Scatter ``k``/``v`` ``[T, H_kv, D]`` into the caches at ``slot_mapping`` ``[T]``."""
    num_blocks, block_size = key_cache.shape[:2]
    slots = np.asarray(slot_mapping, dtype=np.int64)
    key_cache.reshape(num_blocks * block_size, *key_cache.shape[2:])[slots] = k
    value_cache.reshape(num_blocks * block_size, *value_cache.shape[2:])[slots] = v


def gather_context(cache: np.ndarray, block_table: np.ndarray, seq_len: int) -> np.ndarray:
    """The first ``seq_len`` token rows of one sequence, ``[seq_len, H_kv, D]``."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    rows = cache[np.asarray(block_table[:num_blocks], dtype=np.int64)]
    return rows.reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


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
) -> np.ndarray:
    """The contract's ``paged_attention`` by the semantics above; ``[T, H, D_v]`` in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    for cache in (key_cache, value_cache):
        if num_heads % cache.shape[2]:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({cache.shape[2]})")
    k_group, v_group = num_heads // key_cache.shape[2], num_heads // value_cache.shape[2]
    out = np.zeros((num_tokens, num_heads, value_cache.shape[3]), dtype=np.float32)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    for i, seq_len in enumerate(np.asarray(seq_lens, dtype=np.int64).tolist()):
        start, end = int(qsl[i]), int(qsl[i + 1])
        if end == start:
            continue
        keys = gather_context(key_cache, block_tables[i], seq_len).astype(np.float32)
        values = gather_context(value_cache, block_tables[i], seq_len).astype(np.float32)
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
