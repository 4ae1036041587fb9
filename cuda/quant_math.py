"""Device arithmetic shared by the quantized-KV store and load paths: float16 and fp8 codes.

The byte layouts are ``kvpage.core.kv_formats``'; the encoder every kernel must match byte
for byte is ``kvpage.kernels.kv_quant.quantize_rows``. So everything here is float32 with
one IEEE rounding per operation: no fp16 or bit-cast intrinsics (the simulator has neither),
only ``frexp``/``ldexp`` (exact), divisions by powers of two (exact), ``floor`` and integer
arithmetic. Rounding is half to even throughout, as numpy's ``rint`` and ``astype(float16)``.
Inputs are finite (the formats' contract); NaN is not handled.

Device functions only (compiled into each kernel that calls them); every constant is a
float32 or an integer, so no fp64 reaches a kernel.
"""
from __future__ import annotations

import math
from functools import lru_cache
from types import SimpleNamespace

from numba import cuda, float32, int32

from kvpage.kernels.kv_quant import FP8

#: float16's largest finite value rounds up to infinity from here on (half to even).
HALF_OVERFLOW = 65520.0


@cuda.jit(device=True, inline=True)
def rint_even(y):
    """float32 ``y`` rounded to an integer (float32), ties to even: numpy's ``rint``."""
    a = abs(y)
    f = float32(math.floor(a))
    diff = a - f  # exact: f <= a < f + 1 with f >= a / 2, or f == 0
    odd = f - float32(2.0) * float32(math.floor(f * float32(0.5))) != float32(0.0)
    if diff > float32(0.5) or (diff == float32(0.5) and odd):
        f += float32(1.0)
    return float32(math.copysign(f, y))


@cuda.jit(device=True, inline=True)
def pow2(e):
    """float32 ``2**e`` (exact for ``e`` in [-149, 127])."""
    return float32(math.ldexp(float32(1.0), int(e)))


@cuda.jit(device=True, inline=True)
def is_negative(x):
    """The sign bit of float32 ``x`` (True for -0.0)."""
    return math.copysign(float32(1.0), x) < float32(0.0)


@cuda.jit(device=True, inline=True)
def half_round(v):
    """float32 ``v`` rounded to float16, to nearest even: ``(bits, value as float32)``."""
    a = abs(v)
    bits = 0
    val = float32(0.0)
    if a >= float32(HALF_OVERFLOW):
        bits = 0x7C00
        val = float32(math.inf)
    elif a > float32(0.0):
        _, ex = math.frexp(a)
        e = max(ex - 1, -14)  # floor(log2 a), at least the subnormal exponent
        quantum = pow2(e - 10)
        k = rint_even(a / quantum)  # in [0, 2048]: 2048 carries into the next exponent
        bits = (e + 14) * 1024 + int32(k)
        val = k * quantum
    if is_negative(v):
        bits |= 0x8000
        val = -val
    return bits, val


@cuda.jit(device=True, inline=True)
def half_value(bits):
    """The float32 value of float16 ``bits`` (an int in [0, 65535])."""
    e = (bits >> 10) & 31
    m = bits & 1023
    if e == 31:
        val = float32(math.inf)
    elif e == 0:
        val = float32(m) * pow2(-24)
    else:
        val = float32(m + 1024) * pow2(e - 25)
    if bits & 0x8000:
        val = -val
    return val


@lru_cache(maxsize=None)
def fp8_codec(name: str) -> SimpleNamespace:
    """Device functions of fp8 format ``name`` (``kv_quant.FP8``): ``exponent(amax)`` (the
    row's power-of-two scale, ``kv_quant.fp8_exponent``), ``encode(y)`` (the code byte of
    float32 ``y``, ``kv_quant.encode_fp8``) and ``decode(code, e)`` (the float32 value of
    ``code * 2**e``, as ``kv_quant.dequantize_rows``)."""
    exp_bits, man_bits, bias, largest = FP8[name]
    largest_mant, largest_exp = math.frexp(largest)
    # The largest finite code: the encoder never rounds past it (largest is on the grid).
    top = int(math.log2(largest))
    top_code = ((top + bias) << man_bits) | int((largest / 2.0 ** top - 1) * 2 ** man_bits)
    man_mask, exp_mask, lead = (1 << man_bits) - 1, (1 << exp_bits) - 1, 1 << man_bits

    @cuda.jit(device=True, inline=True)
    def exponent(amax):
        e = 0
        if amax > float32(0.0):
            m, ex = math.frexp(amax)
            e = ex - largest_exp
            if m > float32(largest_mant):
                e += 1
            e = min(max(e, -127), 127)
        return e

    @cuda.jit(device=True, inline=True)
    def encode(y):
        a = abs(y)
        bits = 0
        if a > float32(0.0):
            _, ex = math.frexp(a)
            e = max(ex - 1, 1 - bias)  # floor(log2 a), at least the subnormal exponent
            k = int32(rint_even(a / pow2(e - man_bits)))  # in [0, 2 * lead]: the top carries
            bits = min((e + bias - 1) * lead + k, top_code)
        if is_negative(y):
            bits |= 0x80
        return bits

    @cuda.jit(device=True, inline=True)
    def decode(code, e):
        field = (code >> man_bits) & exp_mask
        k = code & man_mask
        if field == 0:
            field = 1  # subnormal: no implicit leading one
        else:
            k += lead
        val = float32(math.ldexp(float32(k), int(field - bias - man_bits + e)))  # one rounding, as np.ldexp
        if code & 0x80:
            val = -val
        return val

    return SimpleNamespace(exponent=exponent, encode=encode, decode=decode, top_code=top_code)
