"""Device helpers of the fast decode kernel (``decode_fast``): wide loads, bit casts, shuffles.

Numba has no 16-byte load and no bf16 array type, so these are LLVM intrinsics: ``ld_v4`` reads
four 32-bit words as one ``ld.global.nc.v4.u32``; fp16 halves widen with ``cvt.f32.f16``; a
bf16 is the top half of an fp32 (a shift or mask, then ``mov.b32``). For 8-bit caches
(``fast_rows``): ``ld_v2`` reads 8 code bytes as one ``ld.global.nc.v2.u32``, ``ld_u8`` and
``ld_u16`` a row's scale, and ``prmt`` (PTX ``prmt.b32``) moves code bytes into float bit
patterns. ``device_helpers(bf16, simulate=True)`` returns numpy stand-ins with the same
semantics instead, so the CUDA simulator can run the kernel (it has neither these intrinsics
nor warp shuffles: ``shfl_xor`` meets the warp's 32 simulator threads at a barrier).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
from llvmlite import ir
from numba import cuda, types, uint16, uint32
from numba.cuda.extending import intrinsic


def _as_u32(context, builder, sig, value):
    return context.cast(builder, value, sig.args[0], types.uint32)


@intrinsic
def _ld_v4(typingctx, arr, offset):
    """Words ``offset .. offset + 3`` of a C-contiguous 32-bit array as one 16-byte load
    (``ld.global.nc.v4.u32``): the address is cast to the global space and marked invariant
    (the kernel never writes KV or q). ``offset`` must be a multiple of 4 from a 16-byte aligned base."""
    sig = types.UniTuple(arr.dtype, 4)(arr, offset)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        ptr = builder.gep(data, [context.cast(builder, args[1], sig.args[1], types.int64)])
        vec = ir.VectorType(ir.IntType(32), 4)
        gptr = builder.addrspacecast(ptr, ir.PointerType(ir.IntType(32), addrspace=1))
        load = builder.load(builder.bitcast(gptr, ir.PointerType(vec, addrspace=1)), align=16)
        load.set_metadata("invariant.load", builder.module.add_metadata([]))
        words = [builder.extract_element(load, ir.Constant(ir.IntType(32), i)) for i in range(4)]
        return context.make_tuple(builder, sig.return_type, words)

    return sig, codegen


def _global_ptr(context, builder, sig, args):
    """The address of byte ``args[1]`` of array ``args[0]``'s data, in the global space."""
    data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
    base = builder.bitcast(data, ir.PointerType(ir.IntType(8)))
    ptr = builder.gep(base, [context.cast(builder, args[1], sig.args[1], types.int64)])
    return builder.addrspacecast(ptr, ir.PointerType(ir.IntType(8), addrspace=1))


def _invariant_load(builder, ptr, ty, align):
    load = builder.load(builder.bitcast(ptr, ir.PointerType(ty, addrspace=1)), align=align)
    load.set_metadata("invariant.load", builder.module.add_metadata([]))
    return load


@intrinsic
def _ld_v2(typingctx, arr, byte_offset):
    """Bytes ``byte_offset .. + 7`` of a C-contiguous array as two little-endian 32-bit words,
    one 8-byte load (``ld.global.nc.v2.u32``); the offset must keep the address 8-byte aligned."""
    sig = types.UniTuple(types.uint32, 2)(arr, byte_offset)

    def codegen(context, builder, sig, args):
        ptr = _global_ptr(context, builder, sig, args)
        load = _invariant_load(builder, ptr, ir.VectorType(ir.IntType(32), 2), 8)
        words = [builder.extract_element(load, ir.Constant(ir.IntType(32), i)) for i in range(2)]
        return context.make_tuple(builder, sig.return_type, words)

    return sig, codegen


def _narrow_load(bits: int):
    @intrinsic
    def load(typingctx, arr, byte_offset):
        sig = types.uint32(arr, byte_offset)

        def codegen(context, builder, sig, args):
            ptr = _global_ptr(context, builder, sig, args)
            value = _invariant_load(builder, ptr, ir.IntType(bits), bits // 8)
            return builder.zext(value, ir.IntType(32))

        return sig, codegen

    return load


#: The unsigned byte, or the little-endian 16-bit word (2-byte aligned), at ``byte_offset`` of an
#: array, zero-extended to uint32 (``ld.global.nc.u8`` / ``.u16``): a row's scale.
_ld_u8 = _narrow_load(8)
_ld_u16 = _narrow_load(16)


@intrinsic
def _prmt(typingctx, a, b, selector):
    """PTX ``prmt.b32 d, a, b, selector`` (default mode): byte ``i`` of ``d`` is byte
    ``(selector >> 4i) & 7`` of the 8 bytes ``b:a`` (``a``'s bytes are 0..3, ``b``'s 4..7)."""
    sig = types.uint32(a, b, selector)

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        vals = [_as_u32(context, builder, types.uint32(t), v) for v, t in zip(args, sig.args)]
        asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32, i32]), "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")
        return builder.call(asm, vals)

    return sig, codegen


@intrinsic
def _half_to_f32(typingctx, word):
    """The fp16 in the low 16 bits of an integer, as fp32 (``cvt.f32.f16``)."""
    def codegen(context, builder, sig, args):
        low = builder.trunc(_as_u32(context, builder, sig, args[0]), ir.IntType(16))
        return builder.fpext(builder.bitcast(low, ir.HalfType()), ir.FloatType())

    return types.float32(word), codegen


@intrinsic
def _half2_to_f32(typingctx, word):
    """The two fp16 halves of a 32-bit word (low half first) as fp32 (``cvt.f32.f16``)."""
    sig = types.UniTuple(types.float32, 2)(word)

    def codegen(context, builder, sig, args):
        pair = builder.bitcast(_as_u32(context, builder, sig, args[0]), ir.VectorType(ir.HalfType(), 2))
        wide = builder.fpext(pair, ir.VectorType(ir.FloatType(), 2))
        vals = [builder.extract_element(wide, ir.Constant(ir.IntType(32), i)) for i in range(2)]
        return context.make_tuple(builder, sig.return_type, vals)

    return sig, codegen


@intrinsic
def _u32_as_f32(typingctx, word):
    """Reinterpret the low 32 bits of an integer as fp32 (``mov.b32``)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(_as_u32(context, builder, sig, args[0]), ir.FloatType())

    return types.float32(word), codegen


@intrinsic
def _f32_as_u32(typingctx, x):
    """The bits of an fp32 value as uint32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _f32_to_f16_bits(typingctx, x):
    """fp32 rounded to fp16 (``cvt.rn.f16.f32``), as its 16 bits."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def _ld_cg(typingctx, arr, offset):
    """Element ``offset`` of a C-contiguous fp32 array, loaded at L2 (``ld.global.cg``): partials
    other blocks wrote during this launch must not come from a stale L1 line."""
    sig = types.float32(arr, offset)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        ptr = builder.gep(data, [context.cast(builder, args[1], sig.args[1], types.int64)])
        asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ptr.type]), "ld.global.cg.f32 $0, [$1];", "=f,l",
                           side_effect=True)
        return builder.call(asm, [ptr])

    return sig, codegen


@dataclass(frozen=True, slots=True)
class DeviceHelpers:
    """The kernel's memory and bit-level operations, for the GPU or for the simulator.

    ``ld_v4(arr, offset)``: 4 words; ``shfl_xor(x, lanemask)``: butterfly exchange over the
    full warp; ``unpack8(w0, w1, w2, w3, out8)``: 8 fp16/bf16 elements to fp32;
    ``to_bits(x)``: fp32 to fp16/bf16 bits (round to nearest even); ``ld_cg(arr, offset)``: an
    fp32 element at a flat offset, bypassing L1 (partials written by other blocks).
    For 8-bit caches (byte offsets into a uint8 array): ``ld_v2`` (8 bytes as 2 words),
    ``ld_u8``/``ld_u16`` (uint32), ``prmt(a, b, selector)``, ``u32_as_f32`` (bit cast),
    ``half2_to_f32(word)`` (two fp32, low half first), ``half_to_f32(word)`` (the low half).
    """

    ld_v4: Callable
    shfl_xor: Callable
    unpack8: Callable
    to_bits: Callable
    ld_cg: Callable
    ld_v2: Callable
    ld_u8: Callable
    ld_u16: Callable
    prmt: Callable
    u32_as_f32: Callable
    half2_to_f32: Callable
    half_to_f32: Callable


@lru_cache(maxsize=None)
def device_helpers(bf16: bool, simulate: bool) -> DeviceHelpers:
    """Helpers for bf16 (else fp16) KV; ``simulate``: numpy versions for the CUDA simulator."""
    return _sim_helpers(bf16) if simulate else _gpu_helpers(bf16)


def _gpu_helpers(bf16: bool) -> DeviceHelpers:
    @cuda.jit(device=True, inline=True)
    def shfl_xor(x, lanemask):
        return cuda.shfl_xor_sync(0xFFFFFFFF, x, lanemask)

    @cuda.jit(device=True, inline=True)
    def unpack8(w0, w1, w2, w3, out8):
        if bf16:  # a bf16 is the top half of an fp32
            out8[0], out8[1] = _u32_as_f32(w0 << 16), _u32_as_f32(w0 & 0xFFFF0000)
            out8[2], out8[3] = _u32_as_f32(w1 << 16), _u32_as_f32(w1 & 0xFFFF0000)
            out8[4], out8[5] = _u32_as_f32(w2 << 16), _u32_as_f32(w2 & 0xFFFF0000)
            out8[6], out8[7] = _u32_as_f32(w3 << 16), _u32_as_f32(w3 & 0xFFFF0000)
        else:
            out8[0], out8[1] = _half2_to_f32(w0)
            out8[2], out8[3] = _half2_to_f32(w1)
            out8[4], out8[5] = _half2_to_f32(w2)
            out8[6], out8[7] = _half2_to_f32(w3)

    @cuda.jit(device=True, inline=True)
    def to_bits(x):
        if bf16:
            bits = _f32_as_u32(x)
            return uint16((bits + uint32(0x7FFF) + ((bits >> 16) & uint32(1))) >> 16)
        return _f32_to_f16_bits(x)

    return DeviceHelpers(_ld_v4, shfl_xor, unpack8, to_bits, _ld_cg, _ld_v2, _ld_u8, _ld_u16, _prmt, _u32_as_f32,
                         _half2_to_f32, _half_to_f32)


_sim_lock = threading.Lock()
_sim_warps: dict = {}


def _sim_shfl_xor(x, lanemask):
    """``shfl_xor_sync`` for the simulator's threads: the warp's 32 threads meet at a barrier."""
    me = threading.current_thread()
    key = (tuple(me.blockIdx), me.thread_id // 32)
    with _sim_lock:
        slot = _sim_warps.setdefault(key, (threading.Barrier(32), [None] * 32))
    barrier, vals = slot
    lane = me.thread_id % 32
    vals[lane] = x
    barrier.wait()
    y = vals[lane ^ int(lanemask)]
    barrier.wait()
    return y


def _sim_helpers(bf16: bool) -> DeviceHelpers:
    def ld_v4(arr, offset):
        idx = np.unravel_index(int(offset), arr.shape)
        return tuple(np.uint32(arr[idx[:-1] + (idx[-1] + k,)]) for k in range(4))

    def unpack8(w0, w1, w2, w3, out8):
        words = np.array([w0, w1, w2, w3], dtype=np.uint32)
        if bf16:
            halves = words.view(np.uint16).astype(np.uint32) << np.uint32(16)
            out8[:] = halves.view(np.float32)
        else:
            out8[:] = words.view(np.float16).astype(np.float32)

    def to_bits(x):
        if bf16:
            bits = int(np.float32(x).view(np.uint32))
            return np.uint16(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF)
        return np.float16(x).view(np.uint16)

    def ld_cg(arr, offset):
        return np.float32(arr[np.unravel_index(int(offset), arr.shape)])

    return DeviceHelpers(ld_v4, _sim_shfl_xor, unpack8, to_bits, ld_cg, _sim_ld_v2, _sim_ld_u8, _sim_ld_u16,
                         _sim_prmt, _sim_u32_as_f32, _sim_half2_to_f32, _sim_half_to_f32)


def _sim_bytes(arr, offset: int, count: int) -> np.ndarray:
    """``count`` bytes of a C-contiguous uint8 array from flat byte ``offset``."""
    inner = getattr(arr, "_item", arr)  # the simulator wraps a kernel's arrays twice
    flat = getattr(inner, "_ary", inner).reshape(-1)
    return np.array(flat[int(offset):int(offset) + count], dtype=np.uint8)


def _sim_ld_v2(arr, offset):
    if int(offset) % 8:
        raise ValueError(f"ld_v2 at byte {int(offset)}: not 8-byte aligned")
    words = _sim_bytes(arr, offset, 8).view(np.uint32)
    return np.uint32(words[0]), np.uint32(words[1])


def _sim_ld_u8(arr, offset):
    return np.uint32(_sim_bytes(arr, offset, 1)[0])


def _sim_ld_u16(arr, offset):
    if int(offset) % 2:
        raise ValueError(f"ld_u16 at byte {int(offset)}: not 2-byte aligned")
    return np.uint32(_sim_bytes(arr, offset, 2).view(np.uint16)[0])


def _sim_prmt(a, b, selector):
    """``prmt.b32`` in the default mode, as the PTX ISA defines it (selector nibbles 0..7)."""
    pool = np.array([int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF], dtype=np.uint32).view(np.uint8)
    sel = int(selector)
    return np.uint32(sum(int(pool[(sel >> (4 * i)) & 7]) << (8 * i) for i in range(4)))


def _sim_u32_as_f32(word):
    return np.array([int(word) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]


def _sim_half2_to_f32(word):
    pair = np.array([int(word) & 0xFFFFFFFF], dtype=np.uint32).view(np.float16).astype(np.float32)
    return pair[0], pair[1]


def _sim_half_to_f32(word):
    return np.float32(np.array([int(word) & 0xFFFF], dtype=np.uint16).view(np.float16)[0])
