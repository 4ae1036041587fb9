"""Fast Numba CUDA decode kernel (one query token per sequence) over paged fp16/bf16 KV, or
over 8-bit quantized KV (int8, fp8 E4M3/E5M2).

Nothing compiles at import time: ``fast_decode_kernel`` builds a ``cuda.jit`` dispatcher per
``(head_dim, group, kv_dtype)`` on first call (cached). ``kvpage.cuda.ptx_check`` compiles
every variant (``fast_signature``) for sm_90 and reports its load widths and resources.

Work decomposition: grid ``(num_seqs, num_kv_heads, num_splits)``, ``FAST_THREADS`` (4 warps)
per block; a block serves every query head of its kv head's GQA group over the keys of its
split. A lane loads 8 elements of a key or value row at a time (16 bytes of fp16/bf16, or 8
code bytes and the row's scale: ``fast_rows``), so ``head_dim / 8`` lanes own one row and a
warp works on ``256 / head_dim`` keys at once; each warp walks its own keys,
``fast_launch.fast_unroll`` steps per iteration with every step's K and V loads issued
before any is used. A quantized row's scale multiplies its score (``s_k * (q . codes)``) and
its softmax weight (``p * s_v``), never the elements.
Dot products reduce by warp shuffles; softmax is online in base 2 (``log2(e)`` folded into the
query scale). At the end, lanes' and warps' (max, sum, acc) states merge through shuffles and a
small shared array. Page ids are staged once per block in shared memory.

Split-K merge is folded in (no second launch): each split writes ``part_max``/``part_sum``/
``part_acc`` (the ``attention_kernels.merge_kernel`` contract, max in natural-log units), then
the last block of a (sequence, kv head) to finish, counted with an atomic on ``counters``,
merges them into ``out`` and resets its counter to 0. ``counters`` must be zero before the
first launch; the kernel leaves it zero.

Arrays are passed as raw bits, so one variant serves fp16 and bf16 without a bf16 array type:
``q`` ``[T, H, D/2]`` and the caches ``[N, B, H_kv, D/2]`` as 32-bit words (two elements each,
C-contiguous, rows 16-byte aligned), ``out`` ``[T, H, D]`` as 16-bit words. Quantized caches
are their uint8 ``[N, block_bytes]`` buffers (q and out fp16). Supported: sliding windows,
softcap, sinks (flags as ``attention_kernels``). Accumulation is fp32.
"""
from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32, int32, int64, uint32

from .fast_intrinsics import device_helpers
from .fast_launch import FAST_MAX_SPLITS, FAST_QUANT_DTYPES, FAST_THREADS, fast_supported, fast_unroll
from .fast_rows import row_reader

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = -math.inf
#: Page ids staged in shared memory per pass; a partition longer than
#: ``(PAGE_CAP - 1) * block_size`` keys is walked in several passes.
PAGE_CAP = 512


@lru_cache(maxsize=None)
def fast_decode_kernel(head_dim: int, group: int, kv_dtype: str, simulate: bool = False):
    """The fast decode kernel for one ``(head_dim, group, kv_dtype)``; ``simulate`` swaps the
    wide loads, byte permutes, bit casts and shuffles for Python versions the CUDA simulator
    can run.

    Kernel signature (launch grid ``(num_seqs, num_kv_heads, num_splits)``, ``FAST_THREADS``)::

        kernel(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scaling,
               window, softcap, sinks, has_sinks, partition, write_partials, out,
               part_max, part_sum, part_acc, counters)

    ``q`` uint32 ``[T, H, D/2]``, caches uint32 ``[N, B, H_kv, D/2]`` (quantized ``kv_dtype``:
    uint8 ``[N, block_bytes]``), ``out`` uint16 ``[T, H, D]`` (bf16 bits for ``kv_dtype``
    bf16, else fp16); metadata int32 as the reference kernel. The grid's y extent must be
    ``H_kv``.
    ``write_partials != 0`` (needs ``num_splits <= FAST_MAX_SPLITS``) writes fp32 partials
    ``[T, H, S(, D)]`` and merges in the last block; ``counters`` int32 ``[num_seqs, H_kv]``.
    """
    if not fast_supported(head_dim, group, kv_dtype):
        raise ValueError(f"no fast decode variant for head_dim={head_dim}, group={group}, kv_dtype={kv_dtype}")
    D, G, NT = head_dim, group, FAST_THREADS
    NW = NT // 32
    LPK = D // 8  # lanes per key row, 8 elements each
    KPS = 32 // LPK  # keys per warp step
    U = fast_unroll(group, kv_dtype)
    KW = U * KPS  # keys per warp iteration
    W = D // 2  # 32-bit words per row
    RED = int(math.log2(LPK))  # shuffle rounds of a dot product
    SUBS = int(math.log2(KPS))  # shuffle rounds merging a warp's key lanes
    G8, U4, UG = G * 8, U * 4, U * G  # local array sizes must be literals
    h = device_helpers(kv_dtype == "bf16", simulate)  # q and out: fp16 unless bf16
    ld_v4, shfl_xor, unpack_q, to_bits, ld_cg = h.ld_v4, h.shfl_xor, h.unpack8, h.to_bits, h.ld_cg
    rd = row_reader(kv_dtype, head_dim, simulate)
    heads_of, block_size_of, load_row, unpack8, row_scale = rd.heads, rd.block_size, rd.load, rd.unpack8, rd.scale
    K_ADJ, V_ADJ = rd.k_adj, rd.v_adj  # powers of two: exact

    @cuda.jit(device=True, inline=True)
    def merge2(m, l, mo, lo):
        """Weights ``(a, b)`` and the merged (max, sum) of two base-2 softmax states."""
        mx = max(m, mo)
        ref = mx if mx != NEG_INF else float32(0.0)  # an empty pair keeps weight 0, not NaN
        a = math.exp2(m - ref)
        b = math.exp2(mo - ref)
        return a, b, mx, l * a + lo * b

    @cuda.jit(fastmath=False)
    def kernel(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scaling, window, softcap,
               sinks, has_sinks, partition, write_partials, out, part_max, part_sum, part_acc, counters):
        # Shared (one array per line: the simulator keys shared arrays by source line): page ids
        # of a pass; per-warp (max, sum, acc); the merge's per-split weights.
        pages_s = cuda.shared.array(PAGE_CAP, int32)
        wm_s = cuda.shared.array((NW, G), float32)
        wl_s = cuda.shared.array((NW, G), float32)
        wacc_s = cuda.shared.array((NW, G, D), float32)
        mw_s = cuda.shared.array((G, FAST_MAX_SPLITS), float32)
        flag_s = cuda.shared.array(1, float32)
        # Registers (every index is a constant after unrolling): query slice, accumulators, a
        # head's running max and sum, one iteration's raw K/V words (8-bit codes: the last two
        # of each four are constant zeros, which vanish) and raw row scales, its scores, 8
        # unpacked elements.
        qf, acc = cuda.local.array(G8, float32), cuda.local.array(G8, float32)
        m, l = cuda.local.array(G, float32), cuda.local.array(G, float32)
        kraw, vraw = cuda.local.array(U4, uint32), cuda.local.array(U4, uint32)
        ksr, vsr = cuda.local.array(U, uint32), cuda.local.array(U, uint32)
        s = cuda.local.array(UG, float32)
        f8 = cuda.local.array(8, float32)

        tid = int32(cuda.threadIdx.x)
        lane, warp = tid % int32(32), tid // int32(32)
        sub, part = lane // int32(LPK), lane % int32(LPK)  # key of the warp step; 8-element slice
        seq = int32(cuda.blockIdx.x)
        kvh = int32(cuda.blockIdx.y)
        split = int32(cuda.blockIdx.z)
        tok = int64(query_start_loc[seq])
        ctx = int32(seq_lens[seq])
        hkv = heads_of(key_cache)
        bs = block_size_of(key_cache, hkv)
        cap = float32(softcap)
        cap_in = float32(LN2) / cap if cap > 0 else float32(0.0)  # base-2 score -> natural / cap
        cap_out = cap * float32(LOG2E)
        klo = int32(0)
        if window > 0:
            klo = max(int32(0), ctx - int32(window))
        kbeg = klo + split * int32(partition)
        kend = min(ctx, kbeg + int32(partition))

        # This lane's 8 query elements of every head, pre-scaled by scaling * log2(e) (and K_ADJ).
        qscale = float32(scaling) * float32(LOG2E * K_ADJ)
        nh = int64(q.shape[1])
        for r in range(G):
            w0, w1, w2, w3 = ld_v4(q, (tok * nh + kvh * G + r) * W + part * 4)
            unpack_q(w0, w1, w2, w3, f8)
            for e in range(8):
                qf[r * 8 + e] = f8[e] * qscale
            m[r] = float32(NEG_INF)
            l[r] = float32(0.0)
        for e in range(G8):
            acc[e] = float32(0.0)

        c0 = kbeg
        while c0 < kend:  # passes of at most PAGE_CAP pages (one for any usual partition)
            p0 = c0 // bs
            c1 = min(kend, (p0 + int32(PAGE_CAP)) * bs)
            cuda.syncthreads()  # the previous pass's readers are done with pages_s
            i = tid
            while i <= (c1 - 1) // bs - p0:
                pages_s[i] = block_tables[seq, p0 + i]
                i += int32(NT)
            cuda.syncthreads()
            it = c0 + warp * int32(KW)
            while it < c1:
                # Page and offset of this lane's first key: one division per iteration.
                rel0 = it - p0 * bs + sub
                pi0 = rel0 // bs
                o0 = rel0 - pi0 * bs
                for u in range(U):
                    o = o0 + int32(u * KPS)
                    pi = pi0
                    while o >= bs:
                        o -= bs
                        pi += int32(1)
                    if it + int32(u * KPS) + sub < c1:
                        pg = pages_s[pi]
                        kraw[u * 4], kraw[u * 4 + 1], kraw[u * 4 + 2], kraw[u * 4 + 3], ksr[u] = load_row(
                            key_cache, pg, o, kvh, hkv, bs, part)
                        vraw[u * 4], vraw[u * 4 + 1], vraw[u * 4 + 2], vraw[u * 4 + 3], vsr[u] = load_row(
                            value_cache, pg, o, kvh, hkv, bs, part)
                    else:
                        for e in range(4):
                            kraw[u * 4 + e] = uint32(0)
                            vraw[u * 4 + e] = uint32(0)
                        ksr[u] = uint32(0)
                        vsr[u] = uint32(0)
                # Scores: partial dots over this lane's 8 elements, reduced across the row's lanes.
                for u in range(U):
                    unpack8(kraw[u * 4], kraw[u * 4 + 1], kraw[u * 4 + 2], kraw[u * 4 + 3], f8)
                    for r in range(G):
                        dot = float32(0.0)
                        for e in range(8):
                            dot += qf[r * 8 + e] * f8[e]
                        s[u * G + r] = dot
                for u in range(U):
                    sk = row_scale(ksr[u])  # 1.0 for fp16/bf16: folded away
                    for r in range(G):
                        x = s[u * G + r]
                        for t in range(RED):
                            x += shfl_xor(x, LPK >> (t + 1))
                        x *= sk
                        if cap > 0:
                            x = cap_out * math.tanh(x * cap_in)
                        if it + int32(u * KPS) + sub >= c1:
                            x = float32(NEG_INF)
                        s[u * G + r] = x
                # Online softmax: one rescale per iteration, then p * V into the accumulators.
                for r in range(G):
                    mx = m[r]
                    for u in range(U):
                        mx = max(mx, s[u * G + r])
                    a, _, mx, tot = merge2(m[r], l[r], mx, float32(0.0))
                    ref = mx if mx != NEG_INF else float32(0.0)
                    for u in range(U):
                        p = math.exp2(s[u * G + r] - ref)
                        s[u * G + r] = p
                        tot += p
                    m[r] = mx
                    l[r] = tot
                    for e in range(8):
                        acc[r * 8 + e] *= a
                for u in range(U):
                    unpack8(vraw[u * 4], vraw[u * 4 + 1], vraw[u * 4 + 2], vraw[u * 4 + 3], f8)
                    sv = row_scale(vsr[u])
                    for r in range(G):
                        p = s[u * G + r] * sv
                        for e in range(8):
                            acc[r * 8 + e] += p * f8[e]
                it += int32(NW * KW)
            c0 = c1

        # Merge the warp's key lanes (lanes LPK apart hold other keys' states), then the warps.
        for t in range(SUBS):
            for r in range(G):
                a, b, m[r], l[r] = merge2(m[r], l[r], shfl_xor(m[r], LPK << t), shfl_xor(l[r], LPK << t))
                for e in range(8):
                    acc[r * 8 + e] = acc[r * 8 + e] * a + shfl_xor(acc[r * 8 + e], LPK << t) * b
        if sub == 0:
            for r in range(G):
                for e in range(8):
                    wacc_s[warp, r, part * 8 + e] = acc[r * 8 + e]
                if part == 0:
                    wm_s[warp, r] = m[r]
                    wl_s[warp, r] = l[r]
        cuda.syncthreads()
        e = tid
        while e < G * D:
            r = e // int32(D)
            d = e % int32(D)
            mx = float32(NEG_INF)
            tot = float32(0.0)
            val = float32(0.0)
            for w in range(NW):
                a, b, mx, tot = merge2(mx, tot, wm_s[w, r], wl_s[w, r])
                val = val * a + wacc_s[w, r, d] * b
            val *= float32(V_ADJ)
            head = kvh * int32(G) + r
            if write_partials != 0:
                part_acc[tok, head, split, d] = val
                if d == 0:
                    part_max[tok, head, split] = mx * float32(LN2)  # natural-log units, as the merge expects
                    part_sum[tok, head, split] = tot
            else:
                scale = float32(1.0)
                if has_sinks != 0:
                    sink = float32(sinks[head]) * float32(LOG2E)
                    scale, b, _, tot = merge2(mx, tot, sink, float32(1.0))
                res = float32(0.0)
                if tot > 0:
                    res = val * scale / tot
                out[tok, head, d] = to_bits(res)
            e += int32(NT)
        if write_partials == 0:
            return

        # Split-K merge in the last block of this (sequence, kv head) to finish.
        cuda.threadfence()
        cuda.syncthreads()
        nsplit = int32(cuda.gridDim.z)
        if tid == 0:
            done = cuda.atomic.add(counters, (seq, kvh), int32(1))
            flag_s[0] = float32(1.0) if done == nsplit - 1 else float32(0.0)
        cuda.syncthreads()
        if flag_s[0] == float32(0.0):
            return
        cuda.threadfence()
        nh = int64(part_max.shape[1])
        ns = int64(part_max.shape[2])
        if tid < G:
            head = int64(kvh * int32(G) + tid)
            row = (tok * nh + head) * ns  # this head's splits in part_max / part_sum
            mx = float32(NEG_INF)
            for sp in range(nsplit):
                mx = max(mx, ld_cg(part_max, row + sp))
            if has_sinks != 0:
                mx = max(mx, float32(sinks[head]))
            tot = float32(0.0)
            for sp in range(nsplit):
                ms = ld_cg(part_max, row + sp)
                wgt = math.exp(ms - mx) if ms != NEG_INF else float32(0.0)
                mw_s[tid, sp] = wgt
                tot += wgt * ld_cg(part_sum, row + sp)
            if has_sinks != 0:
                tot += math.exp(float32(sinks[head]) - mx)
            wm_s[0, tid] = float32(1.0) / tot if tot > 0 else float32(0.0)
        cuda.syncthreads()
        e = tid
        while e < G * D:
            r = e // int32(D)
            d = e % int32(D)
            head = int64(kvh * int32(G) + r)
            row = (tok * nh + head) * ns
            val = float32(0.0)
            for sp in range(nsplit):
                val += mw_s[r, sp] * ld_cg(part_acc, (row + sp) * D + d)
            out[tok, head, d] = to_bits(val * wm_s[0, r])
            e += int32(NT)
        if tid == 0:
            counters[seq, kvh] = 0

    return kernel


def fast_signature(kv_dtype: str = "fp16") -> tuple:
    """The Numba argument types the fast variants of ``kv_dtype`` are compiled for (see
    ``fast_decode_kernel``): the caches are uint8 ``[N, block_bytes]`` for quantized formats."""
    from numba.cuda import types as T

    def arr(dtype, ndim):
        return T.Array(dtype, ndim, "C")

    i32, i64, f32, f64 = T.int32, T.int64, T.float32, T.float64
    cache = arr(T.uint8, 2) if kv_dtype in FAST_QUANT_DTYPES else arr(T.uint32, 4)
    return (arr(T.uint32, 3), cache, cache, arr(i32, 1), arr(i32, 1), arr(i32, 2), f64, i64,
            f64, arr(f32, 1), i64, i64, i64, arr(T.uint16, 3), arr(f32, 3), arr(f32, 3), arr(f32, 4), arr(i32, 2))
