"""Numba CUDA kernel that quantizes a step's new K/V rows into quantized paged caches.

A quantized layer buffer is uint8 ``[num_blocks, block_bytes]``; a block holds the codes
of its ``block_size * heads`` rows (``[block_size, heads, code_bytes]`` from byte 0), then
their scales (``[block_size, heads, scale_bytes]``), per ``KVFormat.block_regions``. The
bytes written for a row equal ``kv_quant.quantize_rows`` of that row widened to float32,
byte for byte (``quant_math`` spells out the arithmetic).

One thread quantizes one (token, head) row of K and the same row of V: the row's absmax
(or per-group min/max, then int4's range search over the group in local arrays) is a
sequential loop over its ``head_dim`` values, then a second pass writes the codes. Rows are independent (scales are per token and head), so no thread
ever reads another's output. Built lazily (``quant_store_kernel``); importing compiles nothing.
"""
from __future__ import annotations

import math
from functools import lru_cache

# Module-level so the simulator can swap ``cuda`` in the kernels' globals.
from numba import cuda, float32, int32, int64

from kvpage.core.kv_formats import KVFormat, int4_group
from kvpage.kernels import kv_quant

from .quant_math import fp8_codec, half_round, pow2, rint_even


def _fp8_row(name: str, head_dim: int):
    codec = fp8_codec(name)
    encode, exponent = codec.encode, codec.exponent
    D = head_dim

    @cuda.jit(device=True, inline=True)
    def store_row(cache, blk, row, rows, x, t, h):
        amax = float32(0.0)
        for d in range(D):
            amax = max(amax, abs(float32(x[t, h, d])))
        e = exponent(amax)
        scale = pow2(-e)  # x * 2**-e: one rounding, as np.ldexp (2**-e is exact for |e| <= 127)
        base = row * D
        for d in range(D):
            cache[blk, base + d] = encode(float32(x[t, h, d]) * scale)
        cache[blk, rows * D + row] = e & 255  # the exponent as a signed byte

    return store_row


def _int8_row(head_dim: int):
    D = head_dim

    @cuda.jit(device=True, inline=True)
    def store_row(cache, blk, row, rows, x, t, h):
        amax = float32(0.0)
        for d in range(D):
            amax = max(amax, abs(float32(x[t, h, d])))
        bits, s = half_round(amax / float32(127.0))
        base = row * D
        for d in range(D):
            c = 0
            if s > float32(0.0):
                y = min(max(float32(x[t, h, d]) / s, float32(-127.0)), float32(127.0))
                c = int32(rint_even(y))  # clip-then-round == round-then-clip: the bounds are integers
            cache[blk, base + d] = c & 255
        at = rows * D + row * 2
        cache[blk, at] = bits & 255
        cache[blk, at + 1] = (bits >> 8) & 255

    return store_row


def _int4_grid(group: int):
    """``grid(x, t, h, g0, lo, hi)``: ``(low, scale)`` before their float16 rounding for the
    group of ``x[t, h, g0:g0 + group]`` (min ``lo``, max ``hi``): ``kv_quant.int4_ranges``,
    integer sums and one float32 operation at a time (no ``a * b + c``, which the GPU may fuse)."""
    G, UNIT, PLAIN_S = group, kv_quant.INT4_UNIT, kv_quant.INT4_PLAIN_STEP
    STARTS, FITS = kv_quant.INT4_STARTS, kv_quant.INT4_FITS

    @cuda.jit(device=True, inline=True)
    def fit_codes(sixteen, S, M, l):
        reciprocal = float32(1.0) / float32(S)
        mf = float32(M)
        error = int64(0)
        for i in range(G):
            c = int32(min(max(rint_even((float32(sixteen[i]) - mf) * reciprocal), float32(0.0)), float32(15.0)))
            l[i] = c
            e = int64(sixteen[i]) - M - int64(c) * S
            error += e * e
        return error

    @cuda.jit(device=True, inline=True)
    def grid(x, t, h, g0, lo, hi):
        span = hi - lo
        low = lo
        scale = span / float32(15.0)
        inverse = float32(16 * UNIT) / span
        if span > float32(0.0) and math.isfinite(span) and math.isfinite(inverse):
            place = cuda.local.array(G, int32)
            sixteen = cuda.local.array(G, int32)
            l = cuda.local.array(G, int32)
            ST = int64(0)
            per_unit = float32(UNIT) / span
            for i in range(G):
                p = int32(rint_even((float32(x[t, h, g0 + i]) - lo) * per_unit))
                place[i] = p
                sixteen[i] = 16 * p
                ST += p
            best_S = int64(PLAIN_S)
            best_M = int64(0)
            best = fit_codes(sixteen, best_S, best_M, l)
            refined = False
            for start in STARTS:
                for i in range(G):
                    y = rint_even(float32(place[i]) * float32(start) / float32(2 * UNIT))
                    l[i] = int32(min(max(y, float32(0.0)), float32(15.0)))
                valid = True
                S = int64(1)
                M = int64(0)
                error = int64(0)
                for _ in range(FITS):
                    if valid:
                        Sl = int64(0)
                        Sll = int64(0)
                        SlT = int64(0)
                        for i in range(G):
                            Sl += l[i]
                            Sll += l[i] * l[i]
                            SlT += l[i] * place[i]
                        den = G * Sll - Sl * Sl
                        num = G * SlT - Sl * ST
                        valid = den > 0 and num > 0
                        if valid:
                            S = int64(rint_even(float32(16 * num) / float32(den)))
                            M = int64(rint_even(float32(16 * (ST * den - num * Sl)) / float32(G * den)))
                            valid = S >= 1 and S < (1 << 22) and abs(M) < (1 << 22)
                            if valid:
                                error = fit_codes(sixteen, S, M, l)
                if valid and error < best:
                    best = error
                    best_S = S
                    best_M = M
                    refined = True
            if refined:
                low = lo + float32(best_M) / inverse
                scale = float32(best_S) / inverse
        return low, scale

    return grid


def _int4_row(head_dim: int):
    D, G = head_dim, int4_group(head_dim)
    NG, CB = D // G, D // 2
    grid = _int4_grid(G)

    @cuda.jit(device=True, inline=True)
    def code(xv, low, s):
        c = 0
        if s > float32(0.0):
            c = int32(rint_even(min(max((xv - low) / s, float32(0.0)), float32(15.0))))
        return c

    @cuda.jit(device=True, inline=True)
    def store_row(cache, blk, row, rows, x, t, h):
        for g in range(NG):
            lo = float32(x[t, h, g * G])
            hi = lo
            for d in range(g * G + 1, (g + 1) * G):
                # Of equal values the last wins, as numpy's min/max reductions pick among signed
                # zeros (for groups of a multiple of 8 values; the sign reaches the stored min).
                xv = float32(x[t, h, d])
                lo = xv if xv <= lo else lo
                hi = xv if xv >= hi else hi
            lo = lo + float32(0.0)  # -0.0 -> +0.0, as kv_quant does: which signed zero min/max pick is order-dependent
            hi = hi + float32(0.0)
            grid_low, grid_scale = grid(x, t, h, g * G, lo, hi)
            low_bits, low = half_round(grid_low)
            scale_bits, s = half_round(grid_scale)
            at = rows * CB + (row * NG + g) * 4  # (scale, min) as two float16s per group
            cache[blk, at] = scale_bits & 255
            cache[blk, at + 1] = (scale_bits >> 8) & 255
            cache[blk, at + 2] = low_bits & 255
            cache[blk, at + 3] = (low_bits >> 8) & 255
            base = row * CB
            for j in range(g * (G // 2), (g + 1) * (G // 2)):  # element 2j: low nibble
                c0 = code(float32(x[t, h, 2 * j]), low, s)
                c1 = code(float32(x[t, h, 2 * j + 1]), low, s)
                cache[blk, base + j] = c0 | (c1 << 4)

    return store_row


def row_encoder(kv_format: str, head_dim: int):
    """``store_row(cache, blk, row, rows, x, t, h)``: quantize ``x[t, h, :]`` into row ``row``
    of block ``blk`` of ``cache`` (uint8 ``[num_blocks, block_bytes]``), a block holding
    ``rows = block_size * heads`` rows."""
    fmt = KVFormat(kv_format)
    if not fmt.quantized:
        raise ValueError(f"{kv_format} is not a quantized format")
    fmt.check_head_dim(head_dim)
    if fmt.is_fp8:
        return _fp8_row(fmt.name, head_dim)
    return _int8_row(head_dim) if fmt.name == "int8" else _int4_row(head_dim)


@lru_cache(maxsize=None)
def quant_store_kernel(kv_format: str, head_dim: int):
    """``kernel(key_cache, value_cache, k, v, slot_mapping, block_size)``, a 1-D grid over
    ``T * H_kv`` rows.

    ``k``/``v`` ``[T, H_kv, head_dim]`` (float16 or float32); caches uint8 ``[num_blocks,
    block_bytes]`` of ``kv_format``; row ``(t, h)`` goes to slot ``slot_mapping[t]``
    (``block = slot // block_size``, ``offset = slot % block_size``, row ``offset * H_kv + h``
    of the block). Negative slots are padding and are skipped.
    """
    store_row = row_encoder(kv_format, head_dim)

    @cuda.jit(fastmath=False)
    def kernel(key_cache, value_cache, k, v, slot_mapping, block_size):
        num_tokens = k.shape[0]
        heads = k.shape[1]
        rows = heads * block_size
        total = num_tokens * heads
        i = int64(cuda.grid(1))
        step = int64(cuda.gridsize(1))
        while i < total:
            t = i // heads
            h = i % heads
            slot = int64(slot_mapping[t])
            if slot >= 0:
                blk = slot // block_size
                row = (slot % block_size) * heads + h
                store_row(key_cache, blk, row, rows, k, t, h)
                store_row(value_cache, blk, row, rows, v, t, h)
            i += step

    return kernel
