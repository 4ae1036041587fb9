"""Quantized K/V rows in numpy: the reference encoder and decoder of every quantized format.

A row's codes and its scales are separate arrays, as they lie in separate regions of a
block (:func:`block_views`). The byte layouts are :mod:`kvpage.core.kv_formats`'. :func:`quantize_rows` is the
definition every other encoder (the native CPU store, the CUDA store) must match byte for
byte, so its arithmetic is spelled out: float32 throughout, divisions (not multiplications
by a reciprocal), rounding half to even, float16 conversions rounding to nearest even.
int4's range search (:func:`int4_ranges`) states its own steps. Inputs are finite.
"""
from __future__ import annotations

import functools

import numpy as np

from kvpage.core.kv_formats import KVFormat, int4_group

#: (exponent bits, mantissa bits, bias, largest finite value) of each fp8 format.
FP8 = {"fp8_e4m3": (4, 3, 7, 448.0), "fp8_e5m2": (5, 2, 15, 57344.0)}


def quantize_rows(x: np.ndarray, fmt: KVFormat) -> tuple[np.ndarray, np.ndarray]:
    """``x`` float ``[..., D]`` (one head's row per last axis) as uint8 ``(codes [..., code_bytes],
    scales [..., scale_bytes])``."""
    if not fmt.quantized:
        raise ValueError(f"{fmt.name} is not a quantized format")
    x = np.ascontiguousarray(x, dtype=np.float32)
    fmt.check_head_dim(x.shape[-1])
    if fmt.is_fp8:
        return _quantize_fp8(x, fmt.name)
    if fmt.name == "int8":
        return _quantize_int8(x)
    return _quantize_int4(x)


def dequantize_rows(codes: np.ndarray, scales: np.ndarray, fmt: KVFormat) -> np.ndarray:
    """The float32 ``[..., D]`` values that uint8 rows ``codes``/``scales`` stand for."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    scales = np.ascontiguousarray(scales, dtype=np.uint8)
    if fmt.is_fp8:
        exponent = scales[..., 0].view(np.int8).astype(np.int32)
        return np.ldexp(fp8_table(fmt.name)[codes], exponent[..., None]).astype(np.float32)
    if fmt.name == "int8":
        return codes.view(np.int8).astype(np.float32) * scales.view(np.float16).astype(np.float32)
    head_dim = 2 * codes.shape[-1]
    group = int4_group(head_dim)
    nibbles = np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], head_dim).astype(np.float32)
    params = scales.view(np.float16).astype(np.float32)  # [..., 2 * groups]: (scale, min) per group
    scale = np.repeat(params[..., 0::2], group, axis=-1)
    low = np.repeat(params[..., 1::2], group, axis=-1)
    return (nibbles * scale + low).astype(np.float32)


def block_views(buffer, fmt: KVFormat, block_size: int, heads: int, head_dim: int) -> tuple:
    """Zero-copy views of a quantized buffer ``[num_blocks, block_bytes]`` (numpy or torch):
    ``(codes [num_blocks, block_size, heads, code_bytes], scales [num_blocks, block_size, heads,
    scale_bytes])``, the regions of :meth:`KVFormat.block_regions`."""
    num_blocks = buffer.shape[0]
    views = []
    for offset, shape in fmt.block_regions(block_size, heads, head_dim):
        size = shape[0] * shape[1] * shape[2]
        region = buffer[:, offset:offset + size]
        views.append(region.reshape(num_blocks, *shape) if isinstance(region, np.ndarray)
                     else region.view(num_blocks, *shape))
    return tuple(views)


def _quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    amax = np.abs(x).max(axis=-1, keepdims=True)
    scale = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.where(scale > 0, np.clip(np.rint(x / safe), -127, 127), 0).astype(np.int8)
    return codes.view(np.uint8), np.ascontiguousarray(scale.astype(np.float16)).view(np.uint8)


#: int4's range search: starting codes of each least-squares fit, as ``rint(T * c / 2**17)``
#: for these ``c`` (the range cut in 14 to 16 steps), and the fits made from each.
INT4_STARTS = (29, 30, 31)
INT4_FITS = 2
#: T's unit: a value's place in its group's [min, max], in 1/65536ths.
INT4_UNIT = 1 << 16
#: The plain grid's step in the fits' units (1/16 of T's): round(16 * 2**16 / 15).
INT4_PLAIN_STEP = (32 * INT4_UNIT + 15) // 30


def int4_ranges(grouped: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``(low, scale)`` ``[..., groups, 1]`` of float32 groups ``[..., groups, G]``,
    before their float16 rounding: the grid :func:`_quantize_int4` codes each group on.

    ``min``/``max`` give the plain grid (``low = min``, ``scale = (max - min) / 15``). It
    spends its two end levels on a group's two extreme values, so each group also tries
    least-squares fits (the idea of llama.cpp's k-quant search):

    1. each value's place in ``[min, max]`` as an integer ``T = rint((x - min) * (2**16 /
       (max - min)))`` (0 where ``max - min`` is 0 or not finite: only the plain grid then);
    2. for each start ``c`` in :data:`INT4_STARTS`, codes ``l = clip(rint(T * c / 2**17), 0, 15)``;
    3. :data:`INT4_FITS` times, the line ``16 T ~ M + l S`` fitted to them by least squares
       from exact integer sums (``den = n sum(l*l) - sum(l)**2``, ``num = n sum(l*T) - sum(l)
       sum(T)``): ``S = rint(f32(16 num) / f32(den))``, ``M = rint(f32(16 (sum(T) den - num
       sum(l))) / f32(n den))`` (a fit is dropped unless ``den > 0``, ``num > 0``, ``1 <= S <
       2**22`` and ``|M| < 2**22``), then ``l = clip(rint(f32(16 T - M) * (1 / f32(S))), 0, 15)``;
    4. the grid whose codes leave the least ``sum (16 T - M - l S)**2`` (an exact integer;
       the plain grid is ``S = 69905``, ``M = 0``) wins, ties keeping the earlier, the plain
       grid first; a fitted grid is ``low = min + f32(M) / f32(2**20 / (max - min))``,
       ``scale = f32(S) / f32(2**20 / (max - min))``.

    Every step is integer arithmetic or one IEEE float32 operation, so the native and CUDA
    stores make the same choice whatever order they sum in.
    """
    n = grouped.shape[-1]
    smallest = grouped.min(axis=-1, keepdims=True) + np.float32(0)  # -0.0 as +0.0: see _quantize_int4
    largest = grouped.max(axis=-1, keepdims=True) + np.float32(0)
    span = largest - smallest
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        inverse = np.float32(16 * INT4_UNIT) / span
        fits = (span > 0) & np.isfinite(span) & np.isfinite(inverse)
        safe_span = np.where(fits, span, np.float32(1))
        place = np.where(fits, np.rint((grouped - smallest) * (np.float32(INT4_UNIT) / safe_span)), 0).astype(np.int64)
    sixteen = 16 * place
    as_float = sixteen.astype(np.float32)  # exact: below 2**21

    def codes(S, M):
        reciprocal = np.float32(1) / S.astype(np.float32)
        return np.clip(np.rint((as_float - M.astype(np.float32)) * reciprocal), 0, 15).astype(np.int64)

    def error(S, M, l):
        e = sixteen - M - l * S
        return (e * e).sum(axis=-1, keepdims=True)

    best_S = np.full(smallest.shape, INT4_PLAIN_STEP, dtype=np.int64)  # the plain grid
    best_M = np.zeros(smallest.shape, dtype=np.int64)
    best = error(best_S, best_M, codes(best_S, best_M))
    refined = np.zeros(smallest.shape, dtype=bool)
    ST = place.sum(axis=-1, keepdims=True)
    for start in INT4_STARTS:
        l = np.clip(np.rint(place.astype(np.float32) * np.float32(start) / np.float32(2 * INT4_UNIT)), 0, 15)
        l = l.astype(np.int64)
        valid = fits.copy()
        for _ in range(INT4_FITS):
            Sl, Sll = l.sum(axis=-1, keepdims=True), (l * l).sum(axis=-1, keepdims=True)
            SlT = (l * place).sum(axis=-1, keepdims=True)
            den, num = n * Sll - Sl * Sl, n * SlT - Sl * ST
            valid &= (den > 0) & (num > 0)
            den, num = np.where(valid, den, 1), np.where(valid, num, 0)
            # 16 num / den and 16 (ST den - num Sl) / (n den), each a float32 division of the
            # integers rounded to float32, then rounded half to even
            S = np.rint((16 * num).astype(np.float32) / den.astype(np.float32)).astype(np.int64)
            M = (16 * (ST * den - num * Sl)).astype(np.float32) / (n * den).astype(np.float32)
            M = np.rint(M).astype(np.int64)
            valid &= (S >= 1) & (S < 1 << 22) & (np.abs(M) < 1 << 22)
            S, M = np.where(valid, S, 1), np.where(valid, M, 0)
            l = codes(S, M)
        e = error(S, M, l)
        take = valid & (e < best)
        best = np.where(take, e, best)
        best_S, best_M = np.where(take, S, best_S), np.where(take, M, best_M)
        refined |= take
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        safe_inverse = np.where(refined, inverse, np.float32(1))
        low = np.where(refined, smallest + best_M.astype(np.float32) / safe_inverse, smallest)
        scale = np.where(refined, best_S.astype(np.float32) / safe_inverse, span / np.float32(15))
    return low.astype(np.float32), scale.astype(np.float32)


def _quantize_int4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    head_dim = x.shape[-1]
    group = int4_group(head_dim)
    grouped = x.reshape(*x.shape[:-1], head_dim // group, group)
    # + 0.0 turns -0.0 into +0.0 (int4_ranges): which signed zero min/max return depends on element order.
    low, scale = int4_ranges(grouped)
    low = low.astype(np.float16).astype(np.float32)
    scale = scale.astype(np.float16).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.where(scale > 0, np.clip(np.rint((grouped - low) / safe), 0, 15), 0).astype(np.uint8)
    codes = codes.reshape(*x.shape[:-1], head_dim // 2, 2)
    params = np.concatenate([scale, low], axis=-1).astype(np.float16)  # [..., groups, 2]: (scale, min)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8)
    return packed, np.ascontiguousarray(params.reshape(*x.shape[:-1], -1)).view(np.uint8)


@functools.lru_cache(maxsize=None)
def fp8_table(name: str) -> np.ndarray:
    """float32 ``[256]``: the value of every fp8 code (NaN codes as NaN; E5M2's infinities)."""
    exp_bits, man_bits, bias, _ = FP8[name]
    bits = np.arange(256)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent = (bits >> man_bits) & ((1 << exp_bits) - 1)
    mantissa = bits & ((1 << man_bits) - 1)
    normal = np.ldexp(1.0 + mantissa / 2**man_bits, exponent - bias)
    subnormal = np.ldexp(mantissa / 2**man_bits, 1 - bias)
    table = sign * np.where(exponent == 0, subnormal, normal)
    top = (1 << exp_bits) - 1
    if name == "fp8_e4m3":
        table[(exponent == top) & (mantissa == (1 << man_bits) - 1)] = np.nan
    else:
        table[(exponent == top) & (mantissa != 0)] = np.nan
        table[(exponent == top) & (mantissa == 0)] = sign[(exponent == top) & (mantissa == 0)] * np.inf
    return table.astype(np.float32)


def fp8_exponent(amax: np.ndarray, name: str) -> np.ndarray:
    """int32: the least ``e`` with ``amax / 2**e`` no more than the format's largest value (0 for 0)."""
    largest = FP8[name][3]
    mant, exp = np.frexp(amax.astype(np.float32))
    largest_mant, largest_exp = np.frexp(np.float32(largest))
    e = exp - largest_exp + (mant > largest_mant)
    return np.where(amax > 0, np.clip(e, -127, 127), 0).astype(np.int32)


def encode_fp8(y: np.ndarray, name: str) -> np.ndarray:
    """uint8 fp8 codes of float32 ``y`` (``|y|`` within the format's range), rounded to
    nearest even."""
    _, man_bits, bias, largest = FP8[name]
    magnitude = np.abs(y).astype(np.float32)
    _, exp = np.frexp(magnitude)
    exponent = np.maximum(exp - 1, 1 - bias)  # floor(log2 |y|), at least the subnormal exponent
    quantum = np.ldexp(np.float32(1), exponent - man_bits).astype(np.float32)
    rounded = np.minimum(np.rint(magnitude / quantum) * quantum, np.float32(largest))
    _, exp = np.frexp(rounded)
    is_normal = rounded >= np.float32(2.0 ** (1 - bias))
    field = np.where(is_normal, exp - 1 + bias, 0)
    step = np.ldexp(np.float32(1), np.where(is_normal, exp - 1, 1 - bias) - man_bits)
    mantissa = np.where(is_normal, rounded / step - (1 << man_bits), rounded / step).astype(np.int32)
    sign = np.where(np.signbit(y), 0x80, 0)  # as torch: -0.0 and values rounding to 0 keep it
    return (sign | (field << man_bits) | mantissa).astype(np.uint8)


def _quantize_fp8(x: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    exponent = fp8_exponent(np.abs(x).max(axis=-1), name)
    scaled = np.ldexp(x, -exponent[..., None]).astype(np.float32)
    return encode_fp8(scaled, name), exponent.astype(np.int8).view(np.uint8)[..., None]
