"""Which decode kernel serves a ``paged_attention`` call, and the fast kernel's launch.

``decode_kernel`` modes: ``"auto"`` picks the fast kernel (``decode_fast``) on a real GPU
whenever ``fast_unsupported`` finds nothing against it, else the reference kernel
(``decode_kernels``); ``"fast"`` requires it (a ValueError says why not) and, under the
simulator, runs its simulator build; ``"reference"`` always takes the reference kernel.

The fast kernel reads q and the caches as 32-bit words and writes ``out`` as 16-bit words, so
one compiled variant serves fp16 and bf16 (torch's bf16 has no Numba array type). Quantized
caches (``cache_format``: int8, fp8_e4m3, fp8_e5m2, int4) are
passed as their uint8 ``[num_blocks, block_bytes]`` buffers, with fp16 q and out. Its split-K
partials and zeroed counters come from the per-(device, stream) ``workspace``: a decode step
allocates nothing and never synchronises.
"""
from __future__ import annotations

import sys
from functools import lru_cache
from typing import Any, Optional

import numpy as np

from .fast_launch import (FAST_BLOCKS_PER_SM, FAST_GROUPS, FAST_HEAD_DIMS, FAST_QUANT_DTYPES, FastScratch,
                          fast_decode_splits, fast_supported, fixed_splits, launch_fast_decode, scratch_shapes)
from .interop import CUPY, NUMBA, NUMPY, TORCH, array_kind, as_kernel_arg, simulator_enabled
from .launch_args import LaunchArgs

DECODE_KERNELS = ("auto", "fast", "reference")
#: The 16-bit dtypes the fast kernel reads, by array dtype name.
FAST_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}


@lru_cache(maxsize=None)
def num_sms() -> int:
    """Streaming multiprocessors of the current device (1 in the simulator)."""
    from numba import cuda

    if simulator_enabled():
        return 1
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def dtype_name(x: Any) -> str:
    """The dtype's name as numpy spells it, torch's ``bfloat16`` included."""
    if array_kind(x) == TORCH:
        return str(x.dtype).removeprefix("torch.")
    return np.dtype(x.dtype).name


def _aligned_c_contiguous(x: Any) -> bool:
    """C-contiguous with a 16-byte aligned base (host numpy: always, it is copied or simulated)."""
    kind = array_kind(x)
    if kind == NUMPY:
        return True
    if kind == TORCH:
        return x.is_contiguous() and x.data_ptr() % 16 == 0
    if kind == CUPY:
        return x.flags.c_contiguous and x.data.ptr % 16 == 0
    return x.is_c_contiguous() and x.__cuda_array_interface__["data"][0] % 16 == 0


def _quant_unsupported(q: Any, key_cache: Any, fmt: Any) -> Optional[str]:
    """Why the fast kernel cannot read a quantized cache of ``fmt`` (a quantized ``CacheFormat``)."""
    name = fmt.kv_format.name
    if name not in FAST_QUANT_DTYPES:
        return f"no fast variant for kv_cache_dtype {name} (compiled: {', '.join(FAST_QUANT_DTYPES)})"
    if dtype_name(q) != "float16":
        return f"q must be float16 for the fast kernel over {name} caches, got {dtype_name(q)}"
    if int(key_cache.shape[1]) % 8:
        return (f"a {name} block of {int(key_cache.shape[1])} bytes is not a multiple of 8 (the 8-byte code loads "
                "need aligned rows)")
    return None


def fast_unsupported(q: Any, key_cache: Any, value_cache: Any, head_dim: int, group: int,
                     fmt: Any = None) -> Optional[str]:
    """Why the fast decode kernel cannot serve these arrays (None: it can); ``fmt``: the caches'
    quantized ``CacheFormat`` (shapes and dtypes already checked by ``quant_ops``), or None."""
    if fmt is not None:
        reason = _quant_unsupported(q, key_cache, fmt)
        if reason:
            return reason
        kv_dtype = fmt.kv_format.name
    else:
        dtypes = {dtype_name(a) for a in (q, key_cache, value_cache)}
        if len(dtypes) != 1 or not dtypes <= FAST_DTYPES.keys():
            return f"q and the caches must share one 16-bit dtype (float16, torch bfloat16), got {sorted(dtypes)}"
        kv_dtype = FAST_DTYPES[dtypes.pop()]
    if not fast_supported(head_dim, group, kv_dtype):
        return (f"no fast variant for head_dim {head_dim}, group {group} (compiled: head_dim {FAST_HEAD_DIMS}, "
                f"group {FAST_GROUPS})")
    for name, arr in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not _aligned_c_contiguous(arr):
            return f"{name} must be C-contiguous with a 16-byte aligned base"
    if array_kind(q) == NUMBA and not _aligned_c_contiguous(q):
        return "q must be C-contiguous with a 16-byte aligned base (a Numba device array is not copied)"
    return None


def use_fast_decode(mode: str, q: Any, key_cache: Any, value_cache: Any, head_dim: int, group: int,
                    has_prefill: bool, fmt: Any = None) -> bool:
    """Whether the decodes of a call go to the fast kernel under ``mode`` (see the module docstring);
    ``fmt``: the caches' quantized ``CacheFormat``, or None.

    Raises ValueError for an unknown mode, for ``"fast"`` when the kernel cannot serve the call,
    and for bfloat16 unless the fast kernel serves every row (the reference kernels have no bf16).
    """
    if mode not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {mode!r}")
    reason = "decode_kernel='reference'" if mode == "reference" else fast_unsupported(q, key_cache, value_cache,
                                                                                      head_dim, group, fmt)
    if mode == "fast" and reason:
        raise ValueError(f"decode_kernel='fast' cannot serve this call: {reason}")
    if mode == "auto" and reason is None and simulator_enabled():
        reason = "the simulator runs the reference kernel unless decode_kernel='fast'"
    if "bfloat16" in {dtype_name(a) for a in (q, key_cache, value_cache)} and (reason or has_prefill):
        raise ValueError("bfloat16 runs only on the fast decode kernel, for batches of decodes alone: "
                         f"{reason or 'the batch has prefill rows'}")
    return reason is None


def _bits(x: Any, width: int, stream: Any) -> Any:
    """``x``'s 16-bit elements as a kernel argument of uint32 words (``width`` 32) or uint16."""
    kind = array_kind(x)
    if kind == TORCH:
        torch = sys.modules["torch"]
        x = x.view(torch.int32 if width == 32 else torch.int16)
    elif kind in (NUMPY, CUPY):
        x = x.view(np.uint32 if width == 32 else np.uint16)
    arg = as_kernel_arg(x, stream)
    want = np.dtype(np.uint32 if width == 32 else np.uint16)
    return arg if arg.dtype == want else arg.view(want)


def _contiguous_q(q: Any) -> Any:
    """``q`` C-contiguous with a 16-byte aligned base (a copy when it is not already)."""
    kind = array_kind(q)
    if kind == NUMPY:
        return np.ascontiguousarray(q)
    if kind == NUMBA or _aligned_c_contiguous(q):  # a Numba q was checked by ``fast_unsupported``
        return q
    if kind == TORCH:  # pool allocations are aligned far beyond 16 bytes
        return q.clone(memory_format=sys.modules["torch"].contiguous_format)
    return q.copy(order="C")


def launch_fast(launch: LaunchArgs, num_decodes: int, num_seqs: int, max_decode_ctx: int,
                num_splits: Optional[int], fmt: Any = None) -> None:
    """The fast kernel over the first ``num_decodes`` sequences of ``launch`` (one token each);
    ``fmt``: the caches' quantized ``CacheFormat`` (``fast_unsupported`` found nothing against
    it), or None.

    ``num_splits`` None sizes split-K from the SM count (``fast_decode_splits``); a number
    fixes it (clamped to ``FAST_MAX_SPLITS``; 1: no partials, no merge).
    """
    from .decode_fast import fast_decode_kernel  # numba.cuda loads here, not before

    q, key_cache, value_cache, out = launch.arrays
    num_heads, head_dim = int(q.shape[1]), int(q.shape[2])
    if fmt is not None:
        _, block_size, num_kv_heads, _ = fmt.logical_shape(tuple(key_cache.shape), head_dim)
        kv_dtype = fmt.kv_format.name
    else:
        block_size, num_kv_heads = int(key_cache.shape[1]), int(key_cache.shape[2])
        kv_dtype = FAST_DTYPES[dtype_name(q)]
    group = num_heads // num_kv_heads
    if num_splits is None:
        splits = fast_decode_splits(num_decodes, num_kv_heads, max_decode_ctx, num_sms(), block_size,
                                    FAST_BLOCKS_PER_SM[group])
    else:
        splits = fixed_splits(max_decode_ctx, num_splits, block_size)
    shapes = scratch_shapes(num_decodes, num_heads, head_dim, num_decodes, num_kv_heads, splits)
    parts = launch.workspace.floats((shapes["part_max"], shapes["part_sum"], shapes["part_acc"]))
    scaling, window, cap, sinks_arg, has_sinks = launch.flags
    scratch = FastScratch(*parts, launch.workspace.counters(shapes["counters"]), sinks_arg)
    qsl, seq_lens, tables = launch.meta
    if num_decodes < num_seqs:
        qsl, seq_lens, tables = qsl[:num_decodes + 1], seq_lens[:num_decodes], tables[:num_decodes]
    if fmt is not None:  # the uint8 buffers as they are
        caches = tuple(as_kernel_arg(a, launch.stream) for a in (key_cache, value_cache))
    else:
        caches = tuple(_bits(a, 32, launch.stream) for a in (key_cache, value_cache))
    bits = (_bits(_contiguous_q(q), 32, launch.stream), *caches)
    kernel = fast_decode_kernel(head_dim, group, kv_dtype, simulate=simulator_enabled())
    launch_fast_decode(kernel, bits, (qsl, seq_lens, tables), scaling, window, cap, bool(has_sinks), splits,
                       _bits(out, 16, launch.stream), scratch, launch.stream, num_kv_heads)
