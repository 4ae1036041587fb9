"""Numba CUDA kernels for paged attention: the tiled kernel for prefill rows, and the
split-K merge kernel that both it and the decode kernel feed.

Nothing here compiles at import time: ``attention_kernel`` and ``merge_kernel`` build a
``cuda.jit`` dispatcher per compile-time configuration on first call (cached), and the
dispatcher compiles per argument dtypes on its first launch.

Decode steps use ``decode_kernels.decode_kernel``; ``attention_kernel`` serves prefill rows
(and any row tile). Work decomposition (``attention_kernel``): one CUDA block per
``(sequence, row tile) x kv_head x split``. A *row* is one (query token, query head)
pair of the GQA group that reads ``kv_head``; a block owns ``rows`` consecutive rows of
its sequence (token-major, head-minor), so a decode block (``rows == group``) holds every
query head of the group and each K/V tile is loaded into shared memory once for all of
them. The block walks its key range in tiles of ``tile`` tokens with an fp32 online
softmax. With split-K (``num_splits > 1``) block ``z`` covers only keys
``[klo + z * partition, klo + (z + 1) * partition)`` and writes unnormalised partials
(running max, running sum, accumulator) that ``merge_kernel`` combines by log-sum-exp.

All reductions use shared memory and ``syncthreads`` (no warp shuffles), so the kernels
run unchanged under the Numba CUDA simulator.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

# Module-level so the simulator can swap ``cuda`` in the kernels' globals; this module is
# imported only by the launch wrappers, never by ``kvpage.cuda`` itself.
from numba import cuda, float32, int32, int64

from .quant_load import kv_loader
from .row_output import write_row_element

# Kernel arguments that are flags use these conventions (runtime values, uniform per launch):
#   window == 0: no sliding window; softcap == 0.0: no softcap; has_sinks == 0: no sinks.
#   write_partials == 0: normalise and write ``out``; 1: write ``part_*`` for the merge.
NEG_INF = -math.inf


@lru_cache(maxsize=None)
def attention_kernel(rows: int, head_dim: int, group: int, tile: int, threads: int,
                     kv_format: Optional[str] = None):
    """The tiled paged-attention kernel for one compile-time configuration.

    Args:
        rows: (token, head) rows per block; ``group`` for decode.
        head_dim: D, elements per head.
        group: query heads per kv head (GQA group size).
        tile: keys per shared-memory tile.
        threads: threads per block (the launch must use exactly this many).
        kv_format: None (or an unquantized format name): caches of values; a quantized
            ``KVFormat`` name: uint8 caches ``[num_blocks, block_bytes]`` whose elements are
            dequantized in registers as the tile loads (``quant_load``).

    Kernel signature (launch grid ``(num_seqs * row_tiles, num_kv_heads, num_splits)``)::

        kernel(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
               seq_offset, row_tiles, scaling, window, softcap, sinks, has_sinks,
               partition, write_partials, out, part_max, part_sum, part_acc)

    ``q``/``out`` are ``[T, H, D]``; caches ``[num_blocks, block_size, H_kv, D]`` (quantized:
    ``[num_blocks, block_bytes]`` uint8, the grid's ``y`` extent being ``H_kv``);
    ``part_max``/``part_sum`` ``[T, H, S]`` fp32; ``part_acc`` ``[T, H, S, D]`` fp32.
    Sequence index of grid row ``x`` is ``seq_offset + x // row_tiles``.
    """
    D = head_dim
    R = rows
    G = group
    TILE = tile
    NT = threads
    KSTRIDE = D + 1  # pad K rows so threads reading K[t, d] for consecutive t hit distinct banks
    PAIRS = -(-(R * D) // NT)  # accumulator elements owned by each thread
    block_size_of, load = kv_loader(kv_format, head_dim)

    @cuda.jit(fastmath=False)
    def kernel(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
               seq_offset, row_tiles, scaling, window, softcap, sinks, has_sinks,
               partition, write_partials, out, part_max, part_sum, part_acc):
        # Per row: its scaled query, its scores of the tile, its running max and sum and this
        # tile's rescale factor.
        q_s = cuda.shared.array((R, D), float32)
        p_s = cuda.shared.array((R, TILE), float32)
        m_s = cuda.shared.array(R, float32)
        l_s = cuda.shared.array(R, float32)
        a_s = cuda.shared.array(R, float32)
        # Per key of the tile: K (rows padded), V, its cache block and its offset in that block.
        k_s = cuda.shared.array((TILE, KSTRIDE), float32)
        v_s = cuda.shared.array((TILE, D), float32)
        tb_s = cuda.shared.array(TILE, int32)
        to_s = cuda.shared.array(TILE, int32)

        tid = cuda.threadIdx.x
        cap = float32(softcap)  # fp32 once: keeps fp64 out of the inner loops
        scale_q = float32(scaling)
        seq = seq_offset + cuda.blockIdx.x // row_tiles
        row_tile = cuda.blockIdx.x % row_tiles
        kv_head = cuda.blockIdx.y
        split = cuda.blockIdx.z

        q_start = int64(query_start_loc[seq])
        q_len = int64(query_start_loc[seq + 1]) - q_start
        ctx = int64(seq_lens[seq])
        row0 = int64(row_tile) * R
        n_rows = min(int64(R), q_len * G - row0)
        if n_rows <= 0:
            return  # whole block past this sequence's rows (ragged batch padding)
        kv_heads = cuda.gridDim.y
        block_size = block_size_of(key_cache, kv_heads)
        first_pos = ctx - q_len + row0 // G
        last_pos = ctx - q_len + (row0 + n_rows - 1) // G

        # Key range this block may need, then this split's share of it.
        klo = int64(0)
        if window > 0:
            klo = max(int64(0), first_pos - window + 1)
        khi = last_pos + 1
        kbeg = klo + int64(split) * partition
        kend = min(khi, kbeg + partition)

        # Stage pre-scaled queries; init running stats.
        e = tid
        while e < R * D:
            r = e // D
            d = e % D
            val = float32(0.0)
            if r < n_rows:
                rr = row0 + r
                tok = q_start + rr // G
                head = kv_head * G + rr % G
                val = float32(q[tok, head, d]) * scale_q
            q_s[r, d] = val
            e += NT
        e = tid
        while e < R:
            m_s[e] = NEG_INF
            l_s[e] = float32(0.0)
            e += NT
        acc = cuda.local.array(PAIRS, float32)  # this thread's accumulator elements
        for k in range(PAIRS):
            acc[k] = float32(0.0)
        cuda.syncthreads()

        t0 = kbeg
        while t0 < kend:
            # 1) K/V tile -> shared (fp32); tokens past kend become zeros. One integer
            #    division per key, not per element, finds its cache block and offset.
            e = tid
            while e < TILE:
                j = int32(t0 + e)
                b = j // block_size
                tb_s[e] = block_tables[seq, b] if j < kend else 0
                to_s[e] = j - b * block_size
                e += NT
            cuda.syncthreads()
            e = tid
            while e < TILE * D:
                t = e // D
                d = e % D
                kv = float32(0.0)
                vv = float32(0.0)
                if t0 + t < kend:
                    kv = load(key_cache, tb_s[t], to_s[t], kv_head, d, kv_heads, block_size)
                    vv = load(value_cache, tb_s[t], to_s[t], kv_head, d, kv_heads, block_size)
                k_s[t, d] = kv
                v_s[t, d] = vv
                e += NT
            cuda.syncthreads()

            # 2) Scores for every (row, key) pair, masked to -inf outside causal/window.
            for e in range(tid, R * TILE, NT):
                r = e // TILE
                t = e % TILE
                j = t0 + t
                s = float32(NEG_INF)
                if r < n_rows and j < kend:
                    pos = ctx - q_len + (row0 + r) // G
                    ok = j <= pos
                    if window > 0:
                        ok = ok and j > pos - window
                    if ok:
                        dot = float32(0.0)
                        for d in range(D):
                            dot += q_s[r, d] * k_s[t, d]
                        if cap > 0:
                            dot = cap * math.tanh(dot / cap)
                        s = dot
                p_s[r, t] = s
            cuda.syncthreads()

            # 3) Per-row online-softmax update; scores become probabilities in place.
            r = tid
            while r < R:
                m_old = m_s[r]
                m_new = m_old
                for t in range(TILE):
                    m_new = max(m_new, p_s[r, t])
                if m_new == NEG_INF:
                    alpha = float32(1.0)  # nothing seen yet: keep zeros
                    for t in range(TILE):
                        p_s[r, t] = float32(0.0)
                else:
                    alpha = float32(math.exp(m_old - m_new))  # exp(-inf) == 0 on the first hit
                    tot = float32(0.0)
                    for t in range(TILE):
                        p = float32(math.exp(p_s[r, t] - m_new))
                        p_s[r, t] = p
                        tot += p
                    l_s[r] = l_s[r] * alpha + tot
                m_s[r] = m_new
                a_s[r] = alpha
                r += NT
            cuda.syncthreads()

            # 4) acc[r, d] = alpha[r] * acc[r, d] + sum_t p[r, t] * V[t, d].
            for k in range(PAIRS):
                e = tid + k * NT
                if e < R * D:
                    r = e // D
                    d = e % D
                    tot = acc[k] * a_s[r]
                    for t in range(TILE):
                        tot += p_s[r, t] * v_s[t, d]
                    acc[k] = tot
            cuda.syncthreads()  # before the next tile overwrites k_s/v_s/p_s
            t0 += TILE

        # Epilogue: partials for the merge, or the normalised output.
        for k in range(PAIRS):
            e = tid + k * NT
            if e < R * D:
                r = e // D
                d = e % D
                if r < n_rows:
                    rr = row0 + r
                    write_row_element(q_start + rr // G, kv_head * G + rr % G, split, d, m_s[r], l_s[r], acc[k],
                                      write_partials, sinks, has_sinks, out, part_max, part_sum, part_acc)

    return kernel


@lru_cache(maxsize=None)
def merge_kernel(head_dim: int, threads: int):
    """Combine split-K partials by log-sum-exp.

    Launch grid ``(num_tokens, num_heads)``, ``threads`` per block::

        kernel(part_max, part_sum, part_acc, num_splits, sinks, has_sinks, token_offset, out)

    For token ``token_offset + blockIdx.x`` and head ``blockIdx.y``:
    ``out = sum_s exp(m_s - M) acc_s / (sum_s exp(m_s - M) l_s [+ exp(sink - M)])`` with
    ``M = max(max_s m_s[, sink])``; splits with ``m_s == -inf`` (no keys) contribute nothing.
    """
    D = head_dim
    NT = threads

    @cuda.jit(fastmath=False)
    def kernel(part_max, part_sum, part_acc, num_splits, sinks, has_sinks, token_offset, out):
        w_s = cuda.shared.array(0, float32)  # dynamic: one weight per split, then the denominator
        tok = token_offset + cuda.blockIdx.x
        head = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        if tid == 0:
            mx = float32(NEG_INF)
            for s in range(num_splits):
                mx = max(mx, part_max[tok, head, s])
            sink = float32(NEG_INF)
            if has_sinks != 0:
                sink = float32(sinks[head])
                mx = max(mx, sink)
            denom = float32(0.0)
            for s in range(num_splits):
                m = part_max[tok, head, s]
                w = float32(0.0)
                if m != NEG_INF:
                    w = math.exp(m - mx)
                w_s[s] = w
                denom += w * part_sum[tok, head, s]
            if has_sinks != 0:
                denom += math.exp(sink - mx)
            w_s[num_splits] = denom
        cuda.syncthreads()
        denom = w_s[num_splits]
        d = tid
        while d < D:
            tot = float32(0.0)
            for s in range(num_splits):
                tot += w_s[s] * part_acc[tok, head, s, d]
            res = float32(0.0)
            if denom > 0:
                res = tot / denom
            out[tok, head, d] = res
            d += NT

    return kernel
