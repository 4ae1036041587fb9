"""Numba CPU paged attention: reads K/V straight from the paged buffers, no gather copy.

Contract: the one in :mod:`kvpage.attention` (same masks, softcap, sinks, GQA rule as
:func:`~kvpage.attention.reference.paged_attention_reference`). Inputs are numpy arrays;
torch CPU tensors are viewed zero-copy by :mod:`kvpage.attention.cpu_kernels`.

Two kernels (the CPU kernels feed both from one precomputed step metadata):
  * decode (the leading query-length-1 sequences): :mod:`kvpage.kernels.numba_decode`.
  * tiled (prefill, chunked prefill, prefix hits): one work item = (tile of up to
    ``cpu_metadata.PREFILL_TILE`` query rows of one sequence, KV head). Per KV block the K
    rows are copied (and converted) into an fp32 ``[head_dim, block_size]`` scratch, so the q.k loop
    vectorizes over the block's tokens and sums ``head_dim`` in order (no fastmath).
  Both use an online (streaming) softmax in fp32, one running max / denominator per row.
  Cache dtypes: float32 is read directly; float16 and bfloat16 caches are passed as
  ``uint16`` bit patterns (numba has no CPU float16 type): float16 goes through an exact
  65536-entry lookup table, bfloat16 by a 16-bit shift into the float32 bit pattern.
  ``q`` is converted to fp32 by the caller (it is small: [T, H, D]).

The first call compiles (a few seconds per cache dtype); ``cache=True`` stores the
machine code next to this file, so later processes start fast.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from numba import get_num_threads, njit, prange, types
from numba.extending import overload

from kvpage.attention.cpu_metadata import build_work_tiles, decodes_of
from kvpage.kernels.numba_decode import run_decode
from kvpage.kernels.numba_math import MODE_BF16, MODE_F16, MODE_F32

# float16 bit pattern -> float32 value; exact (every float16 is representable in float32).
_FP16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def _load_block(cache, blk, h, t0, t1, dst, dst_bits, transpose, mode, table):  # pragma: no cover
    """Copy rows ``t0:t1`` of ``cache[blk, :, h, :]`` into fp32 ``dst`` (transposed if asked)."""


@overload(_load_block, jit_options={"cache": True})
def _load_block_impl(cache, blk, h, t0, t1, dst, dst_bits, transpose, mode, table):
    if cache.dtype == types.float32:
        def load_f32(cache, blk, h, t0, t1, dst, dst_bits, transpose, mode, table):
            for t in range(t0, t1):
                row = cache[blk, t, h]
                if transpose:
                    for d in range(row.shape[0]):
                        dst[d, t] = row[d]
                else:
                    for d in range(row.shape[0]):
                        dst[t, d] = row[d]
        return load_f32

    def load_u16(cache, blk, h, t0, t1, dst, dst_bits, transpose, mode, table):
        for t in range(t0, t1):
            row = cache[blk, t, h]
            for d in range(row.shape[0]):
                if mode == MODE_BF16:
                    bits = np.uint32(row[d]) << np.uint32(16)
                    if transpose:
                        dst_bits[d, t] = bits
                    else:
                        dst_bits[t, d] = bits
                elif transpose:
                    dst[d, t] = table[row[d]]
                else:
                    dst[t, d] = table[row[d]]
    return load_u16


@njit(cache=True)
def _attend_tile(q, kc, vc, bt_row, q0, q_len, seq_len, r0, r1, h, scale, window, softcap,
                 sinks, mode, table, out):
    """Attention of query rows ``r0:r1`` (of ``q_len``) of one sequence, for KV head ``h``."""
    head_dim = q.shape[2]
    block_size = kc.shape[1]
    group = q.shape[1] // kc.shape[2]
    rows = (r1 - r0) * group
    qf = np.empty((rows, head_dim), np.float32)
    for a in range(r1 - r0):
        for g in range(group):
            for d in range(head_dim):
                qf[a * group + g, d] = q[q0 + r0 + a, h * group + g, d] * scale
    m = np.full(rows, -np.inf, np.float32)
    den = np.zeros(rows, np.float32)
    acc = np.zeros((rows, head_dim), np.float32)
    s = np.empty((rows, block_size), np.float32)
    kt = np.empty((head_dim, block_size), np.float32)
    vb = np.empty((block_size, head_dim), np.float32)
    kt_bits = kt.view(np.uint32)
    vb_bits = vb.view(np.uint32)
    p_first = seq_len - q_len + r0
    p_last = seq_len - q_len + r1 - 1
    lo = 0 if window <= 0 else max(0, p_first - window + 1)
    for b in range(lo // block_size, p_last // block_size + 1):
        blk = bt_row[b]
        j0 = b * block_size
        t0 = max(lo - j0, 0)
        t1 = min(p_last - j0 + 1, block_size)
        _load_block(kc, blk, h, t0, t1, kt, kt_bits, True, mode, table)
        _load_block(vc, blk, h, t0, t1, vb, vb_bits, False, mode, table)
        for r in range(rows):
            p = p_first + r // group
            r_lo = 0 if window <= 0 else p - window + 1
            _tile_row_update(qf[r], kt, vb, s[r], t0, t1, j0, r_lo, p, softcap, m, den, acc[r], r)
    for r in range(rows):
        mx = m[r]
        dn = den[r]
        if sinks.shape[0] > 0:
            sink = sinks[h * group + r % group]
            mx_new = max(mx, sink)
            dn = dn * np.exp(mx - mx_new) + np.exp(sink - mx_new)
            mx = mx_new
            inv = np.exp(m[r] - mx) / dn
        else:
            inv = 1.0 / dn
        t = q0 + r0 + r // group
        for d in range(head_dim):
            out[t, h * group + r % group, d] = acc[r, d] * inv


@njit(cache=True)
def _tile_row_update(qr, kt, vb, sr, t0, t1, j0, r_lo, p, softcap, m, den, acc_r, r):
    """Fold tokens ``t0:t1`` of one block into query row ``r``'s streaming softmax."""
    head_dim = qr.shape[0]
    # Tokens of this block the row may see (causal and window); none -> nothing to do.
    a0 = max(t0, r_lo - j0)
    a1 = min(t1, p - j0 + 1)
    if a1 <= a0:
        return
    for t in range(a0, a1):
        sr[t] = 0.0
    for d in range(head_dim):
        qd = qr[d]
        for t in range(a0, a1):
            sr[t] += qd * kt[d, t]
    mb = -np.inf
    for t in range(a0, a1):
        x = sr[t]
        if softcap > 0:
            x = softcap * np.tanh(x / softcap)
            sr[t] = x
        mb = max(mb, x)
    m_new = max(m[r], mb)
    alpha = np.exp(m[r] - m_new)
    block_den = np.float32(0.0)
    for t in range(a0, a1):
        e = np.exp(sr[t] - m_new)
        sr[t] = e
        block_den += e
    den[r] = den[r] * alpha + block_den
    m[r] = m_new
    if alpha != 1.0:
        for d in range(head_dim):
            acc_r[d] *= alpha
    for t in range(a0, a1):
        e = sr[t]
        for d in range(head_dim):
            acc_r[d] += e * vb[t, d]


@njit(parallel=True, nogil=True, cache=True)
def _paged_attention_kernel(q, kc, vc, block_tables, query_start_loc, seq_lens, work, scale,
                            window, softcap, sinks, mode, table, out):
    num_kv_heads = kc.shape[2]
    for item in prange(work.shape[0] * num_kv_heads):
        w = item // num_kv_heads
        h = item % num_kv_heads
        i = work[w, 0]
        q0 = query_start_loc[i]
        q_len = query_start_loc[i + 1] - q0
        _attend_tile(q, kc, vc, block_tables[i], q0, q_len, seq_lens[i], work[w, 1], work[w, 2], h,
                     scale, window, softcap, sinks, mode, table, out)


def cache_mode(cache: np.ndarray, logical_dtype: str) -> tuple[int, np.ndarray]:
    """(mode, table) for a cache array: float32 direct, float16/bfloat16 as uint16 bits."""
    if logical_dtype == "float32" and cache.dtype == np.float32:
        return MODE_F32, _FP16_TABLE[:1]
    if logical_dtype in ("float16", "bfloat16") and cache.dtype == np.uint16:
        return (MODE_F16, _FP16_TABLE) if logical_dtype == "float16" else (MODE_BF16, _FP16_TABLE[:1])
    raise ValueError(f"cache of logical dtype {logical_dtype!r} must be float32 (float32) or uint16 "
                     f"bits (float16/bfloat16), got array dtype {cache.dtype}")


def paged_attention_numba(
    q: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
    query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, scaling: float,
    sliding_window: Optional[int] = None, softcap: Optional[float] = None, sinks: Optional[np.ndarray] = None,
    *,
    cache_dtype: Optional[str] = None,
    num_decodes: Optional[int] = None,
    work: Optional[np.ndarray] = None,
    out: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Paged attention over numpy arrays; returns fp32 ``[T, H, D]`` (``out`` if given).

    ``q`` may be any float dtype (converted to fp32 here: it is small). Caches are float32,
    float16, or uint16 bit patterns with ``cache_dtype`` "float16"/"bfloat16" naming what
    the bits mean. Index arrays are used as int32 (converted if needed).
    The leading ``num_decodes`` sequences (default: the leading run with query length 1)
    take the decode kernel, the rest the tiled kernel over ``work``
    (default ``build_work_tiles(query_start_loc, num_decodes)``); the CPU kernels pass
    both precomputed once per step.
    """
    if key_cache.dtype == np.float16:
        key_cache, value_cache, cache_dtype = key_cache.view(np.uint16), value_cache.view(np.uint16), "float16"
    elif cache_dtype is None:
        cache_dtype = "float32"
    mode, table = cache_mode(key_cache, cache_dtype)
    if value_cache.dtype != key_cache.dtype or value_cache.shape != key_cache.shape:
        raise ValueError(f"key/value caches differ: {key_cache.shape} {key_cache.dtype} vs "
                         f"{value_cache.shape} {value_cache.dtype}")
    num_heads, num_kv_heads = q.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads or q.shape[2] != key_cache.shape[3]:
        raise ValueError(f"q {q.shape} does not fit caches {key_cache.shape}: num_heads must be a "
                         "multiple of num_kv_heads and head_dim must match")
    qsl, lens, tables = _as_i32(query_start_loc), _as_i32(seq_lens), _as_i32(block_tables)
    num_decodes = decodes_of(qsl, num_decodes)
    if work is None:
        work = build_work_tiles(qsl, num_decodes)
    if out is None:
        out = np.zeros(q.shape, dtype=np.float32)
    qf = np.ascontiguousarray(q, dtype=np.float32)
    sinks_arr = np.zeros(0, np.float32) if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
    scale, window, cap = np.float32(scaling), np.int64(sliding_window or 0), np.float32(softcap or 0.0)
    if num_decodes:
        run_decode(qf, key_cache, value_cache, tables, lens, num_decodes, get_num_threads(), scale, window, cap,
                   sinks_arr, np.int64(mode), table, out)
    if work.shape[0]:
        _paged_attention_kernel(qf, key_cache, value_cache, tables, qsl, lens, work, scale, window, cap,
                                sinks_arr, np.int64(mode), table, out)
    return out


@njit(nogil=True, cache=True)
def _store_rows(flat_cache, rows, slots):
    """``flat_cache[slots[t]] = rows[t]`` for every t; a slot outside the cache raises."""
    num_slots = flat_cache.shape[0]
    for t in range(slots.shape[0]):
        slot = slots[t]
        if slot < 0 or slot >= num_slots:
            raise IndexError("KV slot outside the cache")
        for e in range(rows.shape[1]):
            flat_cache[slot, e] = rows[t, e]


def store_kv_numba(key_cache: np.ndarray, value_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
                   slots: np.ndarray) -> None:
    """``write_kv`` on numpy arrays of one dtype (16-bit caches as their ``uint16`` bits):
    caches ``[num_blocks, block_size, H, D]``, ``k``/``v`` ``[T, H, D]``, ``slots`` int64
    ``[T]`` flat slots. One small loop per cache instead of two torch ``index_copy_``
    dispatches: the write is a few KB per layer, and its fixed costs were the measure
    (a bf16 decode step at batch 16: 1.8-1.9 ms of writes per step, 1.1 ms this way)."""
    for cache, rows in ((key_cache, k), (value_cache, v)):
        _store_rows(cache.reshape(-1, cache.shape[2] * cache.shape[3]), rows.reshape(rows.shape[0], -1), slots)


def _as_i32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)
