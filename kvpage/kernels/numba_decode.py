"""Numba CPU paged decode attention: one query row per sequence, K/V read in place from the pool.

Contract: the decode half of :mod:`kvpage.attention`'s ``paged_attention`` (masks, softcap,
sinks and the GQA rule of :func:`~kvpage.attention.reference.paged_attention_reference`)
for sequences whose query is their last context token.

Work item = (sequence, context split), covering every KV head. The item folds its tokens
into a streaming softmax one *partition* (``PARTITION_BLOCKS`` blocks) at a time: all of the
partition's scores first (q.k over ``head_dim``, vectorized by re-association), then one
vectorized exp pass (:func:`~kvpage.kernels.numba_math.exp_nonpositive`) and one rescale
of the accumulators, then p.V (both passes: :func:`_partition_pass`). The ``group`` query
heads of a KV head share each K/V row read (GQA and MQA never expand KV), and a token's
rows of all KV heads, contiguous in the pool, are read together: one item per (sequence,
KV head) would read a strided slice of every block, and the hardware would pull whole
blocks into cache once per KV head.

Long contexts with few sequences are split along the context (``num_splits`` > 1, as in
flash-decoding) so every thread has work; each split leaves (max, denominator,
unnormalized accumulator) and a second pass combines them.

The kernels release the GIL (``nogil``): a server's event loop keeps streaming while the
engine thread is inside attention.

Why flat views with unsigned offsets and no per-token array views: a row view
``cache[blk, t, h]`` costs two atomic reference-count updates on the cache's shared
memory record, a cache line all threads then fight over; signed offsets make numba
emit negative-index wraparound selects that keep LLVM from vectorizing.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from kvpage.kernels.numba_math import exp_nonpositive, load_f32

#: Blocks per softmax partition (the scores scratch holds ``PARTITION_BLOCKS * block_size``
#: tokens per query head). 16 blocks of 16 tokens: the scratch stays in L1.
PARTITION_BLOCKS = 16

_FASTMATH = {"reassoc", "contract"}  # no nnan/ninf: masked -inf stays exact
_U = np.uint64


@njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)
def decode_kernel(q, key_cache, value_cache, block_tables, seq_lens, num_decodes, num_splits, scale, window,
                  softcap, sinks, mode, table, out, part_acc, part_stats, group_size, dim_size):
    """Attention of rows ``0:num_decodes`` of ``q`` (one per sequence) into ``out``.

    ``num_splits`` > 1 uses ``part_acc`` ``[num_decodes, H, num_splits, D]`` and
    ``part_stats`` ``[num_decodes, H, num_splits, 2]`` (max, denominator) as scratch.
    ``group_size`` and ``dim_size`` come from :func:`compile_time_sizes`.
    """
    num_kv_heads = key_cache.shape[2]
    group, head_dim = len(group_size), len(dim_size)
    num_heads = num_kv_heads * group
    block_size = key_cache.shape[1]
    kf, vf = key_cache.reshape(-1), value_cache.reshape(-1)
    for item in prange(num_decodes * num_splits):
        i = item // num_splits
        split = item % num_splits
        seq_len = seq_lens[i]
        lo = 0 if window <= 0 else max(0, seq_len - window)
        chunk = -(-(seq_len - lo) // (num_splits * block_size)) * block_size
        tok_lo = min(lo + split * chunk, seq_len)
        tok_hi = min(tok_lo + chunk, seq_len)
        qf = np.empty(num_heads * head_dim, np.float32)
        for head in range(num_heads):
            for d in range(head_dim):
                qf[_U(head * head_dim + d)] = np.float32(q[i, head, d]) * scale
        acc = np.zeros(num_heads * head_dim, np.float32)
        stats = np.empty(2 * num_heads, np.float32)  # (max, denominator) per query head
        _attend_range(qf, kf, vf, block_tables[i], tok_lo, tok_hi, num_kv_heads, block_size, softcap, mode,
                      table, acc, stats, group_size, dim_size)
        for head in range(num_heads):
            if num_splits == 1:
                _normalize(acc, head, stats[2 * head], stats[2 * head + 1], sinks, head, out[i, head])
            else:
                part_stats[i, head, split, 0] = stats[2 * head]
                part_stats[i, head, split, 1] = stats[2 * head + 1]
                for d in range(head_dim):
                    part_acc[i, head, split, d] = acc[_U(head * head_dim + d)]
    if num_splits > 1:
        _combine_splits(part_acc, part_stats, num_decodes, sinks, out)


@njit(cache=True, fastmath=_FASTMATH)
def _attend_range(qf, kf, vf, table_row, tok_lo, tok_hi, num_kv_heads, block_size, softcap, mode, table, acc,
                  stats, group_size, dim_size):
    """Fold context tokens ``tok_lo:tok_hi`` (all visible) of every KV head into ``acc``.

    ``qf`` holds all ``num_kv_heads * group`` scaled query rows (head-major); ``stats`` ends
    as (max, denominator) per query row, ``acc`` as the unnormalized sum of weights times V
    rows. Each token's K and V rows (all KV heads, contiguous in the pool) are read once.
    """
    group, head_dim = len(group_size), len(dim_size)
    num_heads = num_kv_heads * group
    part = PARTITION_BLOCKS * block_size
    scores = np.empty(num_heads * part, np.float32)
    for head in range(num_heads):
        stats[2 * head] = -np.inf
        stats[2 * head + 1] = 0.0
    if tok_hi <= tok_lo:
        return
    first_block, last_block = tok_lo // block_size, (tok_hi - 1) // block_size
    for pb in range(first_block, last_block + 1, PARTITION_BLOCKS):
        pe = min(pb + PARTITION_BLOCKS, last_block + 1)
        _partition_pass(qf, kf, table_row, pb, pe, tok_lo, tok_hi, num_kv_heads, block_size, mode, table, scores,
                        acc, group_size, dim_size, True)
        base = pb * block_size
        j0 = max(tok_lo - base, 0)
        n = min(tok_hi - base, part) - j0
        for head in range(num_heads):
            _softmax_partition(scores, _U(head * part + j0), n, softcap, stats, head, acc, head_dim)
        _partition_pass(qf, vf, table_row, pb, pe, tok_lo, tok_hi, num_kv_heads, block_size, mode, table, scores,
                        acc, group_size, dim_size, False)


@njit(cache=True, fastmath=_FASTMATH)
def _partition_pass(qf, cache, table_row, pb, pe, tok_lo, tok_hi, num_kv_heads, block_size, mode, table, scores,
                    acc, group_size, dim_size, into_scores):
    """One pass over the visible tokens ``tok_lo:tok_hi`` of blocks ``pb:pe`` (a partition:
    its token ``j`` is column ``j`` of each query head's ``scores`` row) and every query head.

    ``into_scores``: ``cache`` is K, and each score becomes q.k. Otherwise ``cache`` is V,
    and each token's V row, times its (exponentiated) score, is added to ``acc``. Called
    with a constant flag, so each pass compiles to its own loop nest.
    """
    group, head_dim = len(group_size), len(dim_size)
    part = PARTITION_BLOCKS * block_size
    row_stride = num_kv_heads * head_dim
    base = pb * block_size
    for b in range(pb, pe):
        blk = table_row[b]
        for t in range(max(tok_lo - b * block_size, 0), min(tok_hi - b * block_size, block_size)):
            row = _U((blk * block_size + t) * row_stride)
            j = b * block_size + t - base
            for h in range(num_kv_heads):
                off = row + _U(h * head_dim)
                for g in range(group):
                    head = h * group + g
                    ho = _U(head * head_dim)
                    if into_scores:
                        x = np.float32(0.0)
                        for d in range(head_dim):
                            x += qf[ho + _U(d)] * load_f32(cache, off + _U(d), mode, table)
                        scores[_U(head * part + j)] = x
                    else:
                        e = scores[_U(head * part + j)]
                        for d in range(head_dim):
                            acc[ho + _U(d)] += e * load_f32(cache, off + _U(d), mode, table)


@njit(cache=True, fastmath=_FASTMATH)
def _softmax_partition(scores, start, n, softcap, stats, g, acc, head_dim):
    """Turn ``scores[start:start+n]`` into weights under row ``g``'s running max; rescale its
    accumulator and denominator to the new max."""
    if softcap > 0:
        for j in range(n):
            scores[start + _U(j)] = softcap * np.tanh(scores[start + _U(j)] / softcap)
    m_old = stats[2 * g]
    m_new = m_old
    for j in range(n):
        x = scores[start + _U(j)]
        m_new = x if x > m_new else m_new
    total = np.float32(0.0)
    for j in range(n):
        e = exp_nonpositive(scores[start + _U(j)] - m_new)
        scores[start + _U(j)] = e
        total += e
    alpha = np.float32(np.exp(m_old - m_new))  # 0 on the first partition (m_old = -inf)
    stats[2 * g] = m_new
    stats[2 * g + 1] = stats[2 * g + 1] * alpha + total
    if alpha != 1.0:
        ao = _U(g * head_dim)
        for d in range(head_dim):
            acc[ao + _U(d)] *= alpha


@njit(cache=True)
def _normalize(acc, g, m, den, sinks, head, out_row):
    """``out_row = acc[g] / den``; a sink adds ``exp(sink)`` to the denominator only."""
    head_dim = out_row.shape[0]
    inv = np.float32(1.0) / den
    if sinks.shape[0] > 0:
        mx = max(m, sinks[head])
        inv = np.exp(m - mx) / (den * np.exp(m - mx) + np.exp(sinks[head] - mx))
    for d in range(head_dim):
        out_row[d] = acc[_U(g * head_dim + d)] * inv


@njit(parallel=True, nogil=True, cache=True)
def _combine_splits(part_acc, part_stats, num_decodes, sinks, out):
    """Merge the per-split (max, denominator, accumulator) of every decode row into ``out``."""
    num_heads, num_splits, head_dim = part_acc.shape[1], part_acc.shape[2], part_acc.shape[3]
    for row in prange(num_decodes * num_heads):
        i, head = row // num_heads, row % num_heads
        m = -np.inf
        for s in range(num_splits):
            m = max(m, part_stats[i, head, s, 0])
        den = 0.0
        acc = np.zeros(head_dim, np.float32)
        for s in range(num_splits):
            if part_stats[i, head, s, 1] > 0:
                w = np.exp(part_stats[i, head, s, 0] - m)
                den += part_stats[i, head, s, 1] * w
                for d in range(head_dim):
                    acc[d] += part_acc[i, head, s, d] * w
        _normalize(acc, 0, m, np.float32(den), sinks, head, out[i, head])


@functools.lru_cache(maxsize=None)
def compile_time_sizes(*sizes: int) -> tuple:
    """Sizes as the *types* of empty-valued tuples: ``len()`` of a numba tuple is a
    compile-time constant, so the kernel is specialized per (group, head_dim) and LLVM
    unrolls the head_dim loops and drops their remainder code (10-20% measured). One
    compiled (and disk-cached) kernel per model shape."""
    return tuple((0,) * n for n in sizes)


def decode_splits(num_decodes: int, max_context: int, block_size: int, num_threads: int) -> int:
    """Context splits per sequence (every item covers all KV heads): 1 unless that leaves
    fewer than ``4 * num_threads`` items, then enough to reach it, at most one per partition."""
    items = num_decodes
    if items >= 4 * num_threads:
        return 1
    partitions = -(-max_context // (PARTITION_BLOCKS * block_size))
    return max(1, min(partitions, -(-4 * num_threads // items)))


def run_decode(q, key_cache, value_cache, block_tables, seq_lens, num_decodes, num_threads, scale, window, softcap,
               sinks, mode, table, out) -> None:
    """Pick the split count, allocate its scratch and run :func:`decode_kernel` (arguments
    already typed by :func:`~kvpage.attention.numba_cpu.paged_attention_numba`)."""
    max_context = int(seq_lens[:num_decodes].max())
    splits = decode_splits(num_decodes, max_context, key_cache.shape[1], num_threads)
    num_heads, head_dim = q.shape[1], q.shape[2]
    shape = (num_decodes, num_heads, splits) if splits > 1 else (0, 0, 0)
    part_acc = np.empty(shape + (head_dim,), np.float32)
    part_stats = np.empty(shape + (2,), np.float32)
    decode_kernel(q, key_cache, value_cache, block_tables, seq_lens, np.int64(num_decodes), np.int64(splits), scale,
                  window, softcap, sinks, mode, table, out, part_acc, part_stats,
                  *compile_time_sizes(num_heads // key_cache.shape[2], head_dim))
