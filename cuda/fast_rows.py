"""How the fast decode kernel (``decode_fast``) reads a lane's slice of one K or V row.

A lane owns 8 consecutive elements of a row in every format. ``row_reader(kv_dtype,
head_dim, simulate)`` returns the device functions the kernel calls, so one kernel body
serves every format (each is a compile-time choice, inlined):

* ``heads(cache)``: KV heads (a quantized buffer does not say: the launch grid's y extent).
* ``block_size(cache, heads)``: tokens per block.
* ``load(cache, page, off, kvh, heads, bs, part) -> (w0, w1, w2, w3, sraw)``: the raw words
  of slice ``part`` of head ``kvh``'s row of token ``off`` in block ``page``, and the row's
  raw scale bits. Issued together for a whole unrolled iteration before any is used.
* ``unpack8(w0, w1, w2, w3, out8)``: the slice's 8 elements as fp32 (before the row scale).
* ``scale(sraw)``: the row's fp32 scale (1.0 for fp16/bf16: the multiply folds away).
* ``k_adj``/``v_adj``: powers of two the kernel folds into the query and the output (E4M3's
  2**8 below), so ``value = unpack8 * scale * adj`` without ever forming a scale that
  could overflow.

Formats (``kvpage.core.kv_formats``):

* ``fp16``/``bf16``: caches uint32 ``[N, B, H_kv, D/2]`` (two elements a word); one 16-byte
  load per slice.
* ``int8``, ``fp8_e4m3``, ``fp8_e5m2``: the quantized layer buffers, uint8 ``[N, block_bytes]``
  (codes ``[B, H_kv, D]`` at byte 0, then scales ``[B, H_kv, scale_bytes]``). A slice is 8
  code bytes, one 8-byte load (rows and blocks must be 8-byte aligned: ``block_bytes % 8 ==
  0``); the scale is one 1- (fp8: a signed exponent ``e``, scale ``2**e``) or 2-byte (int8:
  fp16 ``s``) load that every lane of the row makes at the same address (one transaction).
  Codes become floats by byte permutes and bit patterns, never by an integer conversion
  (a quarter-rate instruction): int8 ``c`` is ``float(0x4B000000 | (c ^ 0x80)) - (2**23 +
  128)``, exact; an E5M2 byte ``b`` is the fp16 with bits ``b << 8``; an E4M3 byte is the fp16
  with bits ``((b & 0x80) << 8) | ((b & 0x7F) << 7)``, which is its value times ``2**-8``
  (normals and subnormals alike), hence ``adj = 2**8``. Every conversion is exact, so the
  kernel sees exactly ``kv_quant.dequantize_rows``' values, up to where the scale multiplies.
* ``int4``: codes ``[B, H_kv, D/2]`` (element ``2j`` in the low nibble of byte ``j``), then per
  row and group of 32 channels an fp16 scale and minimum. A lane's 8 elements are 4 code
  bytes inside one group, read from one 8-byte load of its pair of lanes; its group's
  (scale, min) from one 8-byte load of two groups' pairs. ``unpack8`` applies them
  (``code * scale + min``, which a GPU may fuse into one FMA; the simulator rounds twice, as
  the reference does), so ``scale`` is 1. A nibble becomes a float through the bits ``0x4B000000 |
  c`` less ``2**23``.
"""
from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

from numba import cuda, float32, int32, int64, uint32

from kvpage.core.kv_formats import KVFormat, int4_group

from .fast_intrinsics import device_helpers

#: Quantized formats the fast kernel reads, and the power of two folded into q and the output.
QUANT_ADJ = {"int8": 1.0, "fp8_e4m3": 256.0, "fp8_e5m2": 1.0, "int4": 1.0}
#: ``2**23 + 128``: an int8 code ``c`` sits in an fp32 ``2**23 + (c ^ 0x80)``.
_INT8_MAGIC = 8388736.0
# prmt selectors: bytes of ``a`` are 0..3, of ``b`` 4..7; nibble i picks result byte i.
_SEL_INT8 = 0x7440  # + i: [code byte i, 0, 0, 0x4B] with b = 0x4B000000
_SEL_HALF_LO, _SEL_HALF_HI = 0x1404, 0x3424  # [0, byte 0, 0, byte 1] / bytes 2, 3 with b = 0


def _words_reader(bf16: bool, head_dim: int, simulate: bool) -> SimpleNamespace:
    h = device_helpers(bf16, simulate)
    ld_v4, W = h.ld_v4, head_dim // 2

    @cuda.jit(device=True, inline=True)
    def heads_of(cache):
        return int64(cache.shape[2])

    @cuda.jit(device=True, inline=True)
    def block_size(cache, heads):
        return int32(cache.shape[1])

    @cuda.jit(device=True, inline=True)
    def load(cache, page, off, kvh, heads, bs, part):
        w0, w1, w2, w3 = ld_v4(cache, ((int64(page) * bs + off) * heads + kvh) * W + part * 4)
        return w0, w1, w2, w3, uint32(0)

    @cuda.jit(device=True, inline=True)
    def scale(sraw):
        return float32(1.0)

    return SimpleNamespace(heads=heads_of, block_size=block_size, load=load, unpack8=h.unpack8, scale=scale,
                           k_adj=1.0, v_adj=1.0)


def _unpack_int8(h):
    prmt, as_f32 = h.prmt, h.u32_as_f32

    @cuda.jit(device=True, inline=True)
    def unpack8(w0, w1, w2, w3, out8):
        a = uint32(w0) ^ uint32(0x80808080)  # signed codes -> offset binary, 4 at a time
        b = uint32(w1) ^ uint32(0x80808080)
        for i in range(4):
            out8[i] = as_f32(prmt(a, uint32(0x4B000000), uint32(_SEL_INT8 + i))) - float32(_INT8_MAGIC)
            out8[4 + i] = as_f32(prmt(b, uint32(0x4B000000), uint32(_SEL_INT8 + i))) - float32(_INT8_MAGIC)

    return unpack8


def _unpack_fp8(h, e4m3: bool):
    prmt, half2 = h.prmt, h.half2_to_f32

    @cuda.jit(device=True, inline=True)
    def to_half2(x):
        """Two fp8 bytes placed as ``[0, b0, 0, b1]`` -> the two fp16s they stand for."""
        if e4m3:  # sign stays in bit 15, exponent and mantissa move down one bit
            x = ((x >> uint32(1)) & uint32(0x3F803F80)) | (x & uint32(0x80008000))
        return half2(x)

    @cuda.jit(device=True, inline=True)
    def unpack8(w0, w1, w2, w3, out8):
        z = uint32(0)
        out8[0], out8[1] = to_half2(prmt(w0, z, uint32(_SEL_HALF_LO)))
        out8[2], out8[3] = to_half2(prmt(w0, z, uint32(_SEL_HALF_HI)))
        out8[4], out8[5] = to_half2(prmt(w1, z, uint32(_SEL_HALF_LO)))
        out8[6], out8[7] = to_half2(prmt(w1, z, uint32(_SEL_HALF_HI)))

    return unpack8


def _unpack_int4(h):
    half_to_f32, as_f32 = h.half_to_f32, h.u32_as_f32

    @cuda.jit(device=True, inline=True)
    def unpack8(w0, w1, w2, w3, out8):
        """w0: the slice's 8 nibbles (element k in bits 4k..4k+3); w1: its group's fp16 scale
        (low half) and minimum (high half). Values ``code * scale + min``."""
        scale = half_to_f32(w1)
        low = half_to_f32(uint32(w1) >> uint32(16))
        for k in range(8):
            code = as_f32(uint32(0x4B000000) | ((uint32(w0) >> uint32(4 * k)) & uint32(15))) - float32(8388608.0)
            out8[k] = code * scale + low

    return unpack8


@cuda.jit(device=True, inline=True)
def _pow2_bits(e):
    """The fp32 bits of ``2**e`` for a signed exponent ``e`` in [-127, 127]."""
    return uint32((e + int32(127)) << int32(23)) if e > int32(-127) else uint32(0x00400000)


def _quant_geometry(row_bytes: int) -> tuple:
    """``heads(cache)`` and ``block_size(cache, heads)`` of a quantized layer buffer whose
    (token, head) rows take ``row_bytes`` (the buffer does not say its heads: the launch
    grid's y extent does)."""

    @cuda.jit(device=True, inline=True)
    def heads_of(cache):
        return int64(cuda.gridDim.y)

    @cuda.jit(device=True, inline=True)
    def block_size(cache, heads):
        return int32(cache.shape[1] // (heads * row_bytes))

    return heads_of, block_size


def _int4_reader(head_dim: int, simulate: bool) -> SimpleNamespace:
    fmt = KVFormat("int4")
    h = device_helpers(False, simulate)
    ld_v2 = h.ld_v2
    CB, SB, ROW = fmt.code_bytes(head_dim), fmt.scale_bytes(head_dim), fmt.row_bytes(head_dim)
    PARTS_PER_GROUP = int4_group(head_dim) // 8
    heads_of, block_size = _quant_geometry(ROW)

    @cuda.jit(device=True, inline=True)
    def load(cache, page, off, kvh, heads, bs, part):
        # 8-byte loads: the two slices' codes around this lane's 4 bytes, and the (scale, min)
        # pairs of two groups around its own (rows of D / 2 and D / 8 bytes: 8-byte aligned)
        base = int64(page) * int64(cache.shape[1])
        row = int64(off) * heads + kvh
        c0, c1 = ld_v2(cache, base + row * CB + (part >> 1) * 8)
        group = part // int32(PARTS_PER_GROUP)
        s0, s1 = ld_v2(cache, base + int64(bs) * heads * CB + row * SB + (group >> 1) * 8)
        return (c1 if part & 1 else c0), (s1 if group & 1 else s0), uint32(0), uint32(0), uint32(0)

    @cuda.jit(device=True, inline=True)
    def scale(sraw):
        return float32(1.0)  # the group scales are applied in unpack8

    return SimpleNamespace(heads=heads_of, block_size=block_size, load=load, unpack8=_unpack_int4(h), scale=scale,
                           k_adj=1.0, v_adj=1.0)


def _codes_reader(name: str, head_dim: int, simulate: bool) -> SimpleNamespace:
    if name == "int4":
        return _int4_reader(head_dim, simulate)
    fmt = KVFormat(name)
    h = device_helpers(False, simulate)
    ld_v2, ld_scale = h.ld_v2, (h.ld_u16 if name == "int8" else h.ld_u8)
    half_to_f32, as_f32 = h.half_to_f32, h.u32_as_f32
    D, SB = head_dim, fmt.scale_bytes(head_dim)
    ROW = fmt.row_bytes(head_dim)
    is_int8 = name == "int8"
    heads_of, block_size = _quant_geometry(ROW)

    @cuda.jit(device=True, inline=True)
    def load(cache, page, off, kvh, heads, bs, part):
        base = int64(page) * int64(cache.shape[1])
        row = int64(off) * heads + kvh
        w0, w1 = ld_v2(cache, base + row * D + part * 8)
        return w0, w1, uint32(0), uint32(0), ld_scale(cache, base + int64(bs) * heads * D + row * SB)

    @cuda.jit(device=True, inline=True)
    def scale(sraw):
        if is_int8:
            return half_to_f32(sraw)
        e = int32(sraw)
        if e > int32(127):
            e -= int32(256)  # a signed byte
        return as_f32(_pow2_bits(e))

    unpack8 = _unpack_int8(h) if is_int8 else _unpack_fp8(h, name == "fp8_e4m3")
    adj = QUANT_ADJ[name]
    return SimpleNamespace(heads=heads_of, block_size=block_size, load=load, unpack8=unpack8, scale=scale, k_adj=adj,
                           v_adj=adj)


@lru_cache(maxsize=None)
def row_reader(kv_dtype: str, head_dim: int, simulate: bool = False) -> SimpleNamespace:
    """The row functions for ``kv_dtype`` (``fp16``, ``bf16`` or a ``QUANT_ADJ`` format)."""
    if kv_dtype in ("fp16", "bf16"):
        return _words_reader(kv_dtype == "bf16", head_dim, simulate)
    if kv_dtype in QUANT_ADJ:
        return _codes_reader(kv_dtype, head_dim, simulate)
    raise ValueError(f"the fast decode kernel reads no KV dtype {kv_dtype!r}")
