"""Scalar building blocks for the Numba CPU kernels, written so LLVM can vectorize loops over them.

* :func:`bits_to_f32` / :func:`f32_to_bits`: bit casts (one LLVM ``bitcast``; numba has no
  scalar ``view``).
* :func:`load_f32`: element ``i`` of a flat cache as float32, whatever the cache holds:
  float32 as is, bfloat16 bits (uint16) widened by a 16-bit shift, float16 bits through
  the exact lookup table. The dtype branch is resolved at compile time for float32
  caches and is loop-invariant (hoisted by LLVM) for the two 16-bit modes.
* :func:`exp_nonpositive`: ``exp(x)`` for the softmax's ``x = score - running max <= 0``,
  branch-free (Cody-Waite range reduction and a degree-6 polynomial; relative error
  below 1e-6 over [-87, 0], exactly 0 below -87, the float32 underflow point). libm's
  ``expf`` is a call LLVM cannot vectorize; this is 13 vector instructions per 16 lanes.

Every function is inlined into its caller (``inline="always"``), so the caller's loops
see straight-line arithmetic.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

MODE_F32, MODE_F16, MODE_BF16 = 0, 1, 2

_LOG2E = np.float32(1.4426950408889634)
# ln 2 split in a short high part (exact products with small integers) and the rest.
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_FLOOR = np.float32(-87.0)
# Minimax coefficients of (exp(r) - 1 - r) / r^2 on [-ln2/2, ln2/2] (Cephes' expf).
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)


@intrinsic
def bits_to_f32(typingctx, bits):
    """The float32 whose bit pattern is the uint32 ``bits``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def f32_to_bits(typingctx, value):
    """The bit pattern of the float32 ``value``, as int32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@njit(inline="always", fastmath={"reassoc", "contract"})
def exp_nonpositive(x):
    """``exp(x)`` for float32 ``x <= 0`` (see module docstring); ``x < -87`` gives 0."""
    v = max(x, _EXP_FLOOR)
    k = np.floor(v * _LOG2E + np.float32(0.5))
    r = (v - k * _LN2_HI) - k * _LN2_LO
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    p = p * r * r + r + np.float32(1.0)
    scaled = bits_to_f32(np.uint32(f32_to_bits(p) + (np.int32(k) << np.int32(23))))
    return scaled if x > _EXP_FLOOR else np.float32(0.0)


def load_f32(cache, i, mode, table):  # pragma: no cover - replaced by the overload
    """``cache[i]`` as float32 (``mode``/``table`` describe 16-bit caches)."""


@overload(load_f32, inline="always", jit_options={"cache": True})
def _load_f32_impl(cache, i, mode, table):
    if cache.dtype == types.float32:
        return lambda cache, i, mode, table: cache[i]

    def load_u16(cache, i, mode, table):
        bits = cache[i]
        if mode == MODE_BF16:
            return bits_to_f32(np.uint32(bits) << np.uint32(16))
        return table[bits]
    return load_u16
