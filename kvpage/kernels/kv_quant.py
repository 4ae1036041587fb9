"""Quantized K/V rows in numpy: the reference encoder and decoder of every quantized format.

The byte layouts are :mod:`kvpage.core.kv_formats`'. :func:`quantize_rows` is the
definition every other encoder (the native CPU store, the CUDA store) must match byte for
byte, so its arithmetic is spelled out: float32 throughout, divisions (not multiplications
by a reciprocal), rounding half to even, float16 conversions rounding to nearest even.
Inputs are finite.
"""
from __future__ import annotations

import functools

import numpy as np

from kvpage.core.kv_formats import KVFormat, int4_group

#: (exponent bits, mantissa bits, bias, largest finite value) of each fp8 format.
FP8 = {"fp8_e4m3": (4, 3, 7, 448.0), "fp8_e5m2": (5, 2, 15, 57344.0)}


def quantize_rows(x: np.ndarray, fmt: KVFormat) -> np.ndarray:
    """``x`` float ``[..., D]`` (one head's row per last axis) as ``uint8 [..., row_bytes(D)]``."""
    if not fmt.quantized:
        raise ValueError(f"{fmt.name} is not a quantized format")
    x = np.ascontiguousarray(x, dtype=np.float32)
    fmt.check_head_dim(x.shape[-1])
    if fmt.is_fp8:
        return _quantize_fp8(x, fmt.name)
    if fmt.name == "int8":
        return _quantize_int8(x)
    return _quantize_int4(x)


def dequantize_rows(codes: np.ndarray, fmt: KVFormat) -> np.ndarray:
    """The float32 ``[..., D]`` values that ``uint8 [..., row_bytes(D)]`` rows stand for."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    head_dim = fmt.head_dim_of(codes.shape[-1])
    if fmt.is_fp8:
        exponent = codes[..., head_dim].view(np.int8).astype(np.int32)
        return np.ldexp(fp8_table(fmt.name)[codes[..., :head_dim]], exponent[..., None]).astype(np.float32)
    if fmt.name == "int8":
        scale = _float16_at(codes, head_dim)
        return codes[..., :head_dim].view(np.int8).astype(np.float32) * scale[..., None]
    group = int4_group(head_dim)
    packed = codes[..., :head_dim // 2]
    nibbles = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*codes.shape[:-1], head_dim).astype(np.float32)
    params = codes[..., head_dim // 2:].copy().view(np.float16).astype(np.float32)  # [..., 2 * groups]
    scale = np.repeat(params[..., 0::2], group, axis=-1)
    low = np.repeat(params[..., 1::2], group, axis=-1)
    return (nibbles * scale + low).astype(np.float32)


def _float16_at(codes: np.ndarray, offset: int) -> np.ndarray:
    return codes[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _quantize_int8(x: np.ndarray) -> np.ndarray:
    amax = np.abs(x).max(axis=-1, keepdims=True)
    scale = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.where(scale > 0, np.clip(np.rint(x / safe), -127, 127), 0).astype(np.int8)
    out = np.empty((*x.shape[:-1], x.shape[-1] + 2), np.uint8)
    out[..., :-2] = codes.view(np.uint8)
    out[..., -2:] = scale.astype(np.float16).view(np.uint8)
    return out


def _quantize_int4(x: np.ndarray) -> np.ndarray:
    head_dim = x.shape[-1]
    group = int4_group(head_dim)
    grouped = x.reshape(*x.shape[:-1], head_dim // group, group)
    low = grouped.min(axis=-1, keepdims=True).astype(np.float16).astype(np.float32)
    high = grouped.max(axis=-1, keepdims=True)
    scale = ((high - grouped.min(axis=-1, keepdims=True)) / np.float32(15)).astype(np.float16).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.where(scale > 0, np.clip(np.rint((grouped - low) / safe), 0, 15), 0).astype(np.uint8)
    codes = codes.reshape(*x.shape[:-1], head_dim // 2, 2)
    params = np.concatenate([scale, low], axis=-1).astype(np.float16)  # [..., groups, 2]: (scale, min)
    out = np.empty((*x.shape[:-1], head_dim // 2 + 4 * (head_dim // group)), np.uint8)
    out[..., :head_dim // 2] = codes[..., 0] | (codes[..., 1] << 4)
    out[..., head_dim // 2:] = params.reshape(*x.shape[:-1], -1).view(np.uint8)
    return out


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


def _quantize_fp8(x: np.ndarray, name: str) -> np.ndarray:
    amax = np.abs(x).max(axis=-1)
    exponent = fp8_exponent(amax, name)
    scaled = np.ldexp(x, -exponent[..., None]).astype(np.float32)
    out = np.empty((*x.shape[:-1], x.shape[-1] + 1), np.uint8)
    out[..., :-1] = encode_fp8(scaled, name)
    out[..., -1] = exponent.astype(np.int8).view(np.uint8)
    return out
