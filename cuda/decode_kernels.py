"""Numba CUDA kernel for decode steps (one query token per sequence) over paged KV.

Nothing compiles at import time: ``decode_kernel`` builds a ``cuda.jit`` dispatcher per
compile-time configuration on first call (cached).

Work decomposition: one CUDA block per ``sequence x kv_head x split``. The block serves
the ``group`` query heads that read ``kv_head`` and the keys ``[kbeg, kend)`` of its split,
at most ``max_partition`` of them, in three passes over that partition:

1. *Scores.* K is staged in shared memory one tile of ``key_tile`` keys at a time
   (coalesced loads, all of a thread's loads issued before any store); each
   ``(key, head[, d-chunk])`` work item takes one dot product, and every score of the
   partition stays in shared memory.
2. *Softmax.* Each head's max and sum come from a shared-memory reduction over
   ``threads // group`` threads; scores become probabilities in place. Two passes over the
   stored scores replace the running-max rescaling of a one-pass online softmax.
3. *Values.* A thread owns one element ``d`` of the head dimension (of one key slice when
   the block has at least twice ``head_dim`` threads) and reads V straight from global
   memory, coalesced across the warp, several keys per round so loads overlap,
   accumulating all ``group`` heads in registers.

The cache block and offset of each key are looked up once per key (one integer division,
not one per element) and kept in shared memory for passes 1 and 3. With split-K the block
writes unnormalised partials for ``attention_kernels.merge_kernel``. Reductions use shared
memory and ``syncthreads`` only (no warp shuffles), so the kernel runs under the Numba
CUDA simulator unchanged.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

from numba import cuda, float32, int32, int64

from .launch_config import score_chunks
from .quant_load import kv_loader
from .row_output import write_row_element

NEG_INF = -math.inf
#: Loads each thread issues before using any of them (K in pass 1, V in pass 3): loads in
#: flight per thread, traded against registers.
VALUE_ROUND = 8


@lru_cache(maxsize=None)
def decode_kernel(head_dim: int, group: int, key_tile: int, max_partition: int, threads: int,
                  kv_format: Optional[str] = None):
    """The decode kernel for one compile-time configuration.

    Args:
        head_dim: D, elements per head.
        group: query heads per kv head (G); ``threads`` must be at least ``group``.
        key_tile: keys per shared-memory K tile.
        max_partition: most keys one block covers (the launch's ``partition`` never exceeds it).
        threads: threads per block (the launch must use exactly this many).
        kv_format: None (or an unquantized format name): caches ``[N, B, H_kv, D]`` of values;
            a quantized ``KVFormat`` name: uint8 caches ``[N, block_bytes]`` whose elements are
            dequantized in registers as they load (``quant_load``).

    Kernel signature (launch grid ``(num_decodes, num_kv_heads, num_splits)``)::

        kernel(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scaling,
               window, softcap, sinks, has_sinks, partition, write_partials, out,
               part_max, part_sum, part_acc)

    Shapes and flag conventions as ``attention_kernels.attention_kernel``; sequence
    ``blockIdx.x`` has exactly one query token, at ``query_start_loc[blockIdx.x]``. The grid's
    ``y`` extent is the number of kv heads (a quantized cache's block size follows from it).
    """
    if threads < group:
        raise ValueError(f"threads_per_block ({threads}) must be at least the heads per kv head ({group})")
    D, G, KT, P, NT = head_dim, group, key_tile, max_partition, threads
    KSTRIDE = D + 1  # padded K rows: threads reading K[t, d] for consecutive t hit distinct banks
    C = score_chunks(D, G, KT, NT)
    DC = D // C
    RT = NT // G  # threads per head in the softmax reductions
    WIDE = NT >= D  # one element d per thread (else DPT elements each)
    KS = NT // D if WIDE else 1  # key slices of pass 3
    DPT = 1 if WIDE else -(-D // NT)
    ACC = DPT * G  # accumulators per thread
    K_LOADS = -(-(KT * D) // NT)  # K elements each thread loads per tile
    U = VALUE_ROUND
    SP = KT * G * C if C > 1 else 1  # partial dots of pass 1
    PV = KS * G * D if KS > 1 else 1  # per-slice accumulators of pass 3
    block_size_of, load = kv_loader(kv_format, head_dim)

    @cuda.jit(fastmath=False)
    def kernel(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scaling, window,
               softcap, sinks, has_sinks, partition, write_partials, out, part_max, part_sum, part_acc):
        q_s = cuda.shared.array((G, D), float32)
        k_s = cuda.shared.array((KT, KSTRIDE), float32)
        s_s = cuda.shared.array((G, P), float32)
        blk_s = cuda.shared.array(P, int32)
        off_s = cuda.shared.array(P, int32)
        red_s = cuda.shared.array(NT, float32)
        sp_s = cuda.shared.array(SP, float32)
        pv_s = cuda.shared.array(PV, float32)
        m_s = cuda.shared.array(G, float32)
        l_s = cuda.shared.array(G, float32)
        v_reg = cuda.local.array(U, float32)  # a round of loads (K in pass 1, V in pass 3)
        acc = cuda.local.array(ACC, float32)

        tid = cuda.threadIdx.x
        cap = float32(softcap)  # fp32 once: keeps fp64 out of the inner loops
        scale_q = float32(scaling)
        seq = cuda.blockIdx.x
        kv_head = cuda.blockIdx.y
        split = cuda.blockIdx.z
        tok = int64(query_start_loc[seq])
        ctx = int64(seq_lens[seq])
        kv_heads = cuda.gridDim.y
        block_size = block_size_of(key_cache, kv_heads)
        klo = int64(0)
        if window > 0:
            klo = max(int64(0), ctx - window)  # the query sits at ctx - 1 and sees window keys
        kbeg = klo + int64(split) * partition
        kend = min(ctx, kbeg + partition)
        n = kend - kbeg  # keys of this block; <= 0 for a split past the context

        # Pre-scaled queries, and each key's cache block and offset.
        e = tid
        while e < G * D:
            r = e // D
            d = e % D
            q_s[r, d] = float32(q[tok, kv_head * G + r, d]) * scale_q
            e += NT
        i = tid
        while i < n:
            j = int32(kbeg + i)
            b = j // block_size
            blk_s[i] = block_tables[seq, b]
            off_s[i] = j - b * block_size
            i += NT
        cuda.syncthreads()

        # Pass 1: scores of the partition, one K tile at a time.
        t0 = 0
        while t0 < n:
            for k0 in range(0, K_LOADS, U):
                for k in range(U):
                    e = tid + (k0 + k) * NT
                    val = float32(0.0)
                    if k0 + k < K_LOADS and e < KT * D:
                        i = t0 + e // D
                        if i < n:
                            val = load(key_cache, blk_s[i], off_s[i], kv_head, e % D, kv_heads, block_size)
                    v_reg[k] = val
                for k in range(U):
                    e = tid + (k0 + k) * NT
                    if k0 + k < K_LOADS and e < KT * D:
                        k_s[e // D, e % D] = v_reg[k]
            cuda.syncthreads()
            e = tid
            while e < KT * G * C:
                t = e % KT
                r = (e // KT) % G
                c = e // (KT * G)
                i = t0 + t
                if i < n:
                    dot = float32(0.0)
                    for dd in range(DC):
                        dot += q_s[r, c * DC + dd] * k_s[t, c * DC + dd]
                    if C == 1:
                        if cap > 0:
                            dot = cap * math.tanh(dot / cap)
                        s_s[r, i] = dot
                    else:
                        sp_s[e] = dot
                e += NT
            if C > 1:
                cuda.syncthreads()
                e = tid
                while e < KT * G:
                    t = e % KT
                    r = e // KT
                    i = t0 + t
                    if i < n:
                        dot = float32(0.0)
                        for c in range(C):
                            dot += sp_s[(c * G + r) * KT + t]
                        if cap > 0:
                            dot = cap * math.tanh(dot / cap)
                        s_s[r, i] = dot
                    e += NT
            cuda.syncthreads()  # before the next tile overwrites k_s
            t0 += KT

        # Pass 2: per-head max, then probabilities and their sum.
        r = tid // RT
        lane = tid % RT
        mx = float32(NEG_INF)
        if r < G:
            i = lane
            while i < n:
                mx = max(mx, s_s[r, i])
                i += RT
        red_s[tid] = mx
        cuda.syncthreads()
        if r < G and lane == 0:
            for k in range(1, RT):
                mx = max(mx, red_s[tid + k])
            m_s[r] = mx
        cuda.syncthreads()
        tot = float32(0.0)
        if r < G:
            m = m_s[r]
            i = lane
            while i < n:
                p = float32(math.exp(s_s[r, i] - m))
                s_s[r, i] = p
                tot += p
                i += RT
        red_s[tid] = tot
        cuda.syncthreads()
        if r < G and lane == 0:
            for k in range(1, RT):
                tot += red_s[tid + k]
            l_s[r] = tot
        cuda.syncthreads()

        # Pass 3: acc[head, d] = sum_i p[head, i] * V[i, d], V read from global memory.
        for k in range(ACC):
            acc[k] = float32(0.0)
        for k in range(DPT):
            d = tid % D if WIDE else tid + k * NT
            first = tid // D if WIDE else 0
            if first < KS and d < D:
                i = first
                while i < n:
                    for u in range(U):
                        ii = i + u * KS
                        val = float32(0.0)
                        if ii < n:
                            val = load(value_cache, blk_s[ii], off_s[ii], kv_head, d, kv_heads, block_size)
                        v_reg[u] = val
                    for u in range(U):
                        ii = i + u * KS
                        if ii < n:
                            for rr in range(G):
                                acc[k * G + rr] += s_s[rr, ii] * v_reg[u]
                    i += U * KS
        if KS > 1:
            d = tid % D
            sl = tid // D
            if sl < KS:
                for rr in range(G):
                    pv_s[(sl * G + rr) * D + d] = acc[rr]
            cuda.syncthreads()
            if sl == 0:
                for rr in range(G):
                    tot = float32(0.0)
                    for s in range(KS):
                        tot += pv_s[(s * G + rr) * D + d]
                    acc[rr] = tot

        # Epilogue: partials for the merge, or the normalised output.
        for k in range(DPT):
            d = tid % D if WIDE else tid + k * NT
            owner = tid < D if WIDE else d < D
            if owner:
                for rr in range(G):
                    write_row_element(tok, kv_head * G + rr, split, d, m_s[rr], l_s[rr], acc[k * G + rr],
                                      write_partials, sinks, has_sinks, out, part_max, part_sum, part_acc)

    return kernel
