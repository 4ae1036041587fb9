"""Device helpers of the fast decode kernel (``decode_fast``): 16-byte loads, bit casts, shuffles.

Numba has no 16-byte load and no bf16 array type, so these are LLVM intrinsics: ``ld_v4`` reads
four 32-bit words as one ``ld.global.nc.v4.u32``; fp16 halves widen with ``cvt.f32.f16``; a
bf16 is the top half of an fp32 (a shift or mask, then ``mov.b32``). ``device_helpers(bf16,
simulate=True)`` returns numpy stand-ins instead, so the CUDA simulator can run the kernel (it
has neither these intrinsics nor warp shuffles: ``shfl_xor`` meets the warp's 32 simulator
threads at a barrier).
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
    """

    ld_v4: Callable
    shfl_xor: Callable
    unpack8: Callable
    to_bits: Callable
    ld_cg: Callable


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

    return DeviceHelpers(_ld_v4, shfl_xor, unpack8, to_bits, _ld_cg)


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

    return DeviceHelpers(ld_v4, _sim_shfl_xor, unpack8, to_bits, ld_cg)
