"""The kernels a :class:`~kvpage.attention.cpu.CPUKernels` binds for torch tensors, by backend and phase.

A *phase* fills its rows of a step into a preallocated result ``[T, H, D]`` of q's dtype:
``decode`` the rows of the leading ``num_decodes`` sequences (rows ``0:num_decodes``, one
per sequence), ``prefill`` those of the sequences after them (rows
``query_start_loc[num_decodes]:``). A *step* (:func:`torch_step`, :meth:`NumbaKernels.step`,
:class:`PhasedStep`) returns the whole result; a *store* scatters K/V rows
``[T, H_kv, D]`` into their flat slots. The native and numba kinds hold what is fixed
when they are bound (the native library, the element type); per call they read only the
step's tensors, its :class:`~kvpage.attention.cpu_metadata.CPUAttentionMetadata` and the
layer's :class:`~kvpage.attention.cpu_metadata.LayerCall`. The caches are contiguous CPU
buffers ``[num_blocks, block_size, H_kv, D]`` of that element type (checked at bind), or
quantized uint8 ``[num_blocks, block_bytes]`` buffers whose format the kinds hold (the
element type is then q's, the output's and the new K/V rows').
"""
from __future__ import annotations

import ctypes
from typing import Callable, Optional

import numpy as np
import torch

from kvpage.attention import torch_cpu
from kvpage.attention import quantized_torch, tiled_torch
from kvpage.attention.cpu_metadata import CPUAttentionMetadata, LayerCall, kernel_dtype_name, to_numpy
from kvpage.core.kv_formats import CacheFormat
from kvpage.kernels import native_cpu

Phase = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, CPUAttentionMetadata, LayerCall], None]
_NO_WORK = np.zeros((0, 3), np.int32)  # numba tiles of a decode-only call


def row_slots(slot_mapping, k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
    """``slot_mapping`` as int64 numpy, one slot per K and per V row (else ``ValueError``)."""
    slots = to_numpy(slot_mapping, np.int64)
    if slots.shape[0] != k.shape[0] or slots.shape[0] != v.shape[0]:
        raise ValueError(f"slot_mapping has {slots.shape[0]} slots for {k.shape[0]} K and {v.shape[0]} V rows")
    return slots


class NativeKernels:
    """The C++ kernels of :mod:`kvpage.kernels.native_cpu` for one element type, on torch's thread pool.

    Over quantized caches: ``cache_format`` is the native kernels' name of the format and
    ``cache_shape`` the buffers' logical ``(num_blocks, block_size, H_kv, D)`` (both fixed
    at bind); ``dtype_name`` is then q's element type. Unquantized: both None (the shape is
    the buffers')."""

    __slots__ = ("lib", "dtype_name", "cache_shape", "_format")

    def __init__(self, lib: ctypes.CDLL, dtype_name: str, cache_format: Optional[str] = None,
                 cache_shape: Optional[tuple] = None) -> None:
        self.lib, self.dtype_name, self.cache_shape = lib, dtype_name, cache_shape
        self._format = {} if cache_format is None else {"cache_format": cache_format}  # the calls' keyword

    def decode(self, result, q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> None:
        q = q if q.stride(-1) == 1 else q.contiguous()
        num_threads = torch.get_num_threads()
        shape = self.cache_shape or tuple(key_cache.shape)
        native_cpu.decode_attention(
            self.lib, self.dtype_name, q.data_ptr(), q.stride()[:2], key_cache.data_ptr(), value_cache.data_ptr(),
            shape, q.shape[1], md.block_tables, md.seq_lens, md.num_decodes, call.scaling,
            int(call.sliding_window or 0), float(call.softcap or 0.0), call.sinks_f32(), result.data_ptr(),
            md.decode_splits(num_threads, shape[1]), num_threads, **self._format)

    def prefill(self, result, q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> None:
        q = q if q.stride(-1) == 1 else q.contiguous()
        native_cpu.prefill_attention(
            self.lib, self.dtype_name, q.data_ptr(), q.stride()[:2], key_cache.data_ptr(), value_cache.data_ptr(),
            self.cache_shape or tuple(key_cache.shape), q.shape[1], md.block_tables, md.query_start_loc, md.seq_lens,
            md.num_decodes, call.scaling, int(call.sliding_window or 0), float(call.softcap or 0.0),
            call.sinks_f32(), result.data_ptr(), torch.get_num_threads(), **self._format)

    def write_and_decode(self, q, k, v, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall,
                         write: bool) -> torch.Tensor:
        """A decode-only step's K/V writes (unless ``write`` is False) and attention in one
        native call; the caller checked :meth:`fits`."""
        num_threads = torch.get_num_threads()
        sinks = call.sinks_f32()
        result = q.new_empty(q.shape)
        qs = q.stride()
        shape = self.cache_shape or tuple(key_cache.shape)
        rows = (None, None, None)
        if write:
            ks, vs = k.stride(), v.stride()
            rows = ((k.data_ptr(), ks[0], ks[1]), (v.data_ptr(), vs[0], vs[1]), md.slots_address)
        native_cpu.write_decode(
            self.lib, self.dtype_name, (q.data_ptr(), qs[0], qs[1]), *rows, q.shape[0], key_cache.data_ptr(),
            value_cache.data_ptr(), shape, q.shape[1], md.native_step(num_threads, shape[1]),
            call.scaling, int(call.sliding_window or 0), float(call.softcap or 0.0),
            None if sinks is None else sinks.ctypes.data, result.data_ptr(), num_threads, **self._format)
        return result

    @staticmethod
    def fits(q, k, v, md: CPUAttentionMetadata, call: LayerCall, write: bool, dtype: torch.dtype,
             row_shape: tuple) -> bool:
        """Whether this step and these tensors take :meth:`write_and_decode` (the layout was checked at bind)."""
        if not md.decode_only or q.shape[0] != md.num_decodes or q.stride(-1) != 1 or call.is_variant:
            return False
        if not write:
            return True
        return (md.slot_mapping is not None and md.slot_mapping.shape[0] == q.shape[0] and k.dtype == dtype
                and v.dtype == dtype and k.shape[1:] == row_shape and v.shape[1:] == row_shape
                and k.stride(-1) == 1 and v.stride(-1) == 1)

    def store(self, key_cache, value_cache, k, v, slot_mapping) -> None:
        slots = row_slots(slot_mapping, k, v)
        for cache, rows in ((key_cache, k), (value_cache, v)):
            rows = rows.to(cache.dtype)
            if rows.shape[1:] != cache.shape[2:]:
                raise ValueError(f"K/V rows of shape {tuple(rows.shape[1:])} do not fit cache rows "
                                 f"{tuple(cache.shape[2:])}")
            if rows.stride(2) != 1:
                rows = rows.contiguous()
            native_cpu.store_rows(self.lib, cache.data_ptr(), tuple(cache.shape), cache.element_size(),
                                  rows.data_ptr(), rows.stride()[:2], slots)


class QuantizedStore:
    """The K/V store of quantized caches: the native quantizing store
    (``native_cpu.store_quantized``) where ``lib`` is given and has it, else the numpy
    encoder and a byte scatter (:func:`quantized_torch.store_rows`); the bytes are the same."""

    __slots__ = ("lib", "cache_format", "_name")

    def __init__(self, lib: Optional[ctypes.CDLL], cache_format: CacheFormat) -> None:
        fmt = cache_format.kv_format
        native = (lib is not None and hasattr(native_cpu, "store_quantized")
                  and fmt.name in getattr(native_cpu, "CACHE_FORMATS", {}))
        self.lib, self.cache_format, self._name = (lib if native else None), cache_format, fmt.name

    def store(self, key_cache, value_cache, k, v, slot_mapping) -> None:
        slots = row_slots(slot_mapping, k, v)
        for cache, rows in ((key_cache, k), (value_cache, v)):
            shape = self.cache_format.logical_shape(tuple(cache.shape), int(rows.shape[2]))
            if tuple(rows.shape[1:]) != shape[2:]:
                raise ValueError(f"K/V rows of shape {tuple(rows.shape[1:])} do not fit {self._name} cache rows "
                                 f"{shape[2:]}")
            if self.lib is None or not _native_stores(shape[3]):
                quantized_torch.store_rows(cache, rows, torch.from_numpy(slots), self.cache_format)
                continue
            if kernel_dtype_name(rows.dtype) is None:
                rows = rows.float()
            if rows.stride(2) != 1:
                rows = rows.contiguous()
            native_cpu.store_quantized(self.lib, self._name, cache.data_ptr(), shape, kernel_dtype_name(rows.dtype),
                                       rows.data_ptr(), rows.stride()[:2], slots)


def _native_stores(head_dim: int) -> bool:
    """Whether the native quantizing store takes rows of ``head_dim`` values."""
    return head_dim % native_cpu.HEAD_DIM_MULTIPLE == 0 and 0 < head_dim <= native_cpu.MAX_HEAD_DIM


def _numba_view(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as numba sees it: fp32 as is, 16-bit floats as uint16 bits."""
    return (t if t.dtype == torch.float32 else t.view(torch.uint16)).numpy()


class NumbaKernels:
    """The numba kernels of :mod:`~kvpage.attention.numba_cpu` on zero-copy views of the
    caches (16-bit floats as their bits); q goes in as fp32, results come out in fp32."""

    __slots__ = ("dtype_name", "_attention", "_store")

    def __init__(self, dtype_name: str) -> None:
        from kvpage.attention import numba_cpu

        self.dtype_name = dtype_name
        self._attention, self._store = numba_cpu.paged_attention_numba, numba_cpu.store_kv_numba

    def _run(self, q, key_cache, value_cache, md, call, num_decodes: int, work: np.ndarray, out: np.ndarray) -> None:
        self._attention(q.detach().float().numpy(), _numba_view(key_cache), _numba_view(value_cache),
                        md.query_start_loc, md.seq_lens, md.block_tables, call.scaling, call.sliding_window,
                        call.softcap, call.sinks_f32(), cache_dtype=self.dtype_name, num_decodes=num_decodes,
                        work=work, out=out)

    def step(self, q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> torch.Tensor:
        """Both phases in one call."""
        out = np.zeros(tuple(q.shape), dtype=np.float32)
        self._run(q, key_cache, value_cache, md, call, md.num_decodes, md.work, out)
        return torch.from_numpy(out).to(q.dtype)

    def decode(self, result, q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> None:
        nd = md.num_decodes
        direct = result.dtype == torch.float32  # write straight into the result
        out = result.numpy() if direct else np.empty((nd, *q.shape[1:]), np.float32)
        self._run(q[:nd], key_cache, value_cache, md, call, nd, _NO_WORK, out)
        if not direct:
            result[:nd] = torch.from_numpy(out)

    def prefill(self, result, q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> None:
        direct = result.dtype == torch.float32
        out = result.numpy() if direct else np.empty(tuple(q.shape), np.float32)
        self._run(q, key_cache, value_cache, md, call, 0, md.work, out)
        if not direct:
            first = int(md.query_start_loc[md.num_decodes])
            result[first:] = torch.from_numpy(out[first:])

    def store(self, key_cache, value_cache, k, v, slot_mapping) -> None:
        slots = row_slots(slot_mapping, k, v)
        rows = [_numba_view(x.to(key_cache.dtype).contiguous()) for x in (k, v)]
        self._store(_numba_view(key_cache), _numba_view(value_cache), *rows, slots)


def _sinks_tensor(call: LayerCall) -> Optional[torch.Tensor]:
    return None if call.sinks is None else torch.as_tensor(call.sinks, dtype=torch.float32)


def torch_decode(result, q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> None:
    """Gather + SDPA (:func:`torch_cpu.decode_torch`) of the decode rows."""
    nd = md.num_decodes
    result[:nd] = torch_cpu.decode_torch(q[:nd], key_cache, value_cache, md.torch_index("seq_lens")[:nd],
                                         md.torch_index("block_tables")[:nd], call.scaling, call.sliding_window,
                                         call.softcap, _sinks_tensor(call))


def torch_prefill(result, q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> None:
    """Gather + SDPA (:func:`torch_cpu.prefill_one_torch`) per prefill sequence."""
    sinks = _sinks_tensor(call)
    tables = md.torch_index("block_tables")
    bounds = md.query_start_loc.tolist()
    for i, seq_len in enumerate(md.seq_lens.tolist()[md.num_decodes:], start=md.num_decodes):
        start, end = bounds[i], bounds[i + 1]
        if end > start:
            result[start:end] = torch_cpu.prefill_one_torch(q[start:end], key_cache, value_cache, seq_len, tables[i],
                                                            call.scaling, call.sliding_window, call.softcap, sinks)


def torch_step(q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> torch.Tensor:
    """The whole step on torch (:func:`torch_cpu.paged_attention_torch`): any K/V layouts,
    chunked attention and ALiBi included; returns ``[T, H, D_v]``."""
    slopes = None if call.alibi_slopes is None else torch.as_tensor(call.alibi_slopes, dtype=torch.float32)
    return torch_cpu.paged_attention_torch(
        q, key_cache, value_cache, md.torch_index("query_start_loc"), md.torch_index("seq_lens"),
        md.torch_index("block_tables"), call.scaling, call.sliding_window, call.softcap, call.sinks,
        num_decodes=md.num_decodes, attention_chunk=call.attention_chunk, alibi_slopes=slopes)


class TiledKernels:
    """Torch's step and phases over quantized caches of one format
    (:func:`tiled_torch.paged_attention_tiled`: every row computed alike however the step
    was scheduled); chunked attention and ALiBi included."""

    __slots__ = ("cache_format",)

    def __init__(self, cache_format: CacheFormat) -> None:
        self.cache_format = cache_format

    def _run(self, q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall, seqs=None, out=None):
        return tiled_torch.paged_attention_tiled(
            q, key_cache, value_cache, md.torch_index("query_start_loc"), md.torch_index("seq_lens"),
            md.torch_index("block_tables"), call.scaling, call.sliding_window, call.softcap, call.sinks,
            cache_format=self.cache_format, seqs=seqs, out=out, attention_chunk=call.attention_chunk,
            alibi_slopes=call.alibi_slopes)

    def step(self, q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> torch.Tensor:
        return self._run(q, key_cache, value_cache, md, call)

    def decode(self, result, q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> None:
        self._run(q, key_cache, value_cache, md, call, range(md.num_decodes), result)

    def prefill(self, result, q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> None:
        self._run(q, key_cache, value_cache, md, call, range(md.num_decodes, md.seq_lens.shape[0]), result)


def torch_phases(cache_format: Optional[CacheFormat]) -> tuple[Callable, Phase, Phase]:
    """Torch's (step, decode phase, prefill phase): :func:`torch_step`, :func:`torch_decode`
    and :func:`torch_prefill`, or over a quantized ``cache_format`` :class:`TiledKernels`'."""
    if cache_format is None:
        return torch_step, torch_decode, torch_prefill
    tiled = TiledKernels(cache_format)
    return tiled.step, tiled.decode, tiled.prefill


def torch_store(key_cache, value_cache, k, v, slot_mapping) -> None:
    torch_cpu.write_kv_torch(key_cache, value_cache, k, v, slot_mapping)


class PromptRowsStep:
    """A step whose every row, decode rows included, one prefill phase computes: a row then
    has the bits it gets inside a prompt, however the step was scheduled
    (``CPUKernelChoice.schedule_invariant``)."""

    __slots__ = ("prefill",)

    def __init__(self, prefill: Phase) -> None:
        self.prefill = prefill

    def __call__(self, q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> torch.Tensor:
        result = q.new_empty(q.shape)
        self.prefill(result, q, key_cache, value_cache, md.as_prompt_rows(), call)
        return result


class PhasedStep:
    """A step whose decode and prefill rows take different kernels, into one result."""

    __slots__ = ("decode", "prefill")

    def __init__(self, decode: Phase, prefill: Phase) -> None:
        self.decode, self.prefill = decode, prefill

    def __call__(self, q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> torch.Tensor:
        result = q.new_empty(q.shape)
        if md.num_decodes:
            self.decode(result, q, key_cache, value_cache, md, call)
        if not md.decode_only:
            self.prefill(result, q, key_cache, value_cache, md, call)
        return result
