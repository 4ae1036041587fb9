"""CPU paged attention: each attention site's kernels are chosen once, then called per step.

Contract: the one in :mod:`kvpage.attention` (``write_kv`` and ``paged_attention``, same
masks, softcap, sinks, chunked attention, ALiBi and GQA rule as the reference), on torch
CPU tensors or numpy arrays; results come back in q's kind and dtype, ``[T, H, D_v]``.

* :class:`CPUKernels` binds the kernels of one :class:`AttentionLayout` (what a site's
  q and K/V buffers fix for the model's life: element types, head counts and sizes,
  contiguity) under a :class:`CPUKernelChoice` and this machine's features (the native
  library, numba): a decode kernel, a prefill kernel, a K/V store, and the fused native
  write-and-decode where it serves. :func:`choose_kernels` (in
  :mod:`~kvpage.attention.cpu_layout`, with the layouts) states the rules. Per call it
  reads only the step's :class:`~kvpage.attention.cpu_metadata.CPUAttentionMetadata`
  (built once per step) and the layer's :class:`~kvpage.attention.cpu_metadata.LayerCall`.
* :class:`CPUAttention` is one model's set: a site's kernels are bound on its first call
  and found again by the identity of its K/V buffers.
* :func:`paged_attention_cpu`, :func:`write_kv_cpu` and :func:`write_and_attend_cpu` bind
  per call: for tests, benchmarks and one-off callers, not for a model's steps.

Quantized caches (``cache_format=`` a quantized :class:`~kvpage.core.kv_formats.CacheFormat`:
uint8 ``[num_blocks, block_bytes]`` buffers) are known when a layout is bound: decode and
prefill run on the native kernels where they take the format, else on torch (which
dequantizes each context's gathered rows), never on numba; stores quantize (natively where
the library can, else the numpy encoder: the same bytes).

Import is torch- and numba-free; the backends load when a layout is bound.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from kvpage.attention.cpu_layout import (BACKENDS, NUMBA_DECODE_MAX_HEAD_DIM, AttentionLayout, CacheLayout,
                                         CPUKernelChoice, choose_kernels, native_format)
from kvpage.attention.cpu_metadata import CPUAttentionMetadata, LayerCall, prepare_cpu_attention_metadata
from kvpage.core.kv_formats import CacheFormat, resolve_kv_format

if TYPE_CHECKING:
    from kvpage.attention.cpu_metadata import Array

__all__ = ["BACKENDS", "NUMBA_DECODE_MAX_HEAD_DIM", "AttentionLayout", "CacheLayout", "CPUKernelChoice",
           "choose_kernels", "CPUKernels", "CPUAttention", "choose_store", "paged_attention_cpu", "write_kv_cpu",
           "write_and_attend_cpu", "kv_layouts_differ", "cpu_kernels_summary"]

#: ``store(key_cache, value_cache, k, v, slot_mapping)``: the contract's ``write_kv``.
Store = Callable[..., None]


def _native_library():
    from kvpage.kernels import native_cpu

    return native_cpu.library()


def _numba_available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


class CPUKernels:
    """The kernels of one :class:`AttentionLayout`, chosen once; see the module docstring.

    ``decode_backend``/``prefill_backend`` name the chosen backends (:func:`choose_kernels`).
    """

    __slots__ = ("layout", "decode_backend", "prefill_backend", "_schedule_invariant", "_step", "_variant", "_store",
                 "_fused", "_fused_rows")

    def __init__(self, layout: AttentionLayout, choice: CPUKernelChoice = CPUKernelChoice()) -> None:
        lib = _native_library() if layout.cache.tensors else None  # numpy inputs never take it
        self.layout = layout
        self.decode_backend, self.prefill_backend = choose_kernels(layout, choice, lib is not None,
                                                                   _numba_available())
        self._schedule_invariant = choice.schedule_invariant
        self._store = choose_store(layout.cache)
        self._fused = self._fused_rows = None
        if not layout.cache.tensors:
            fmt = layout.cache.cache_format
            reference = _reference_step if fmt is None else functools.partial(_reference_step, cache_format=fmt)
            self._step = _numba_numpy_step if self.decode_backend == "numba" else reference
            self._variant = reference
        else:
            self._bind_torch(lib)

    def _bind_torch(self, lib) -> None:
        from kvpage.attention import cpu_kernels as kernels

        layout = self.layout
        decode, prefill, fmt = self.decode_backend, self.prefill_backend, layout.cache.cache_format
        # The kernels' element type: the caches' own, or over quantized bytes q's (and the output's).
        dtype = layout.cache.dtype if fmt is None else layout.q_dtype
        native = None
        if "native" in (decode, prefill):
            native = (kernels.NativeKernels(lib, dtype) if fmt is None
                      else kernels.NativeKernels(lib, dtype, native_format(fmt), layout.cache_shape))
        numba = kernels.NumbaKernels(dtype) if "numba" in (decode, prefill) else None
        torch_step, torch_decode, torch_prefill = kernels.torch_phases(fmt)
        self._variant = torch_step
        if self._schedule_invariant:  # every row through the prefill phase (decode == prefill here)
            phases = {"native": native, "numba": numba}
            self._step = kernels.PromptRowsStep(torch_prefill if prefill == "torch" else phases[prefill].prefill)
            return
        if decode == prefill == "torch":
            self._step = torch_step
        elif decode == prefill == "numba":
            self._step = numba.step
        else:
            phases = {"native": native, "numba": numba}
            self._step = kernels.PhasedStep(torch_decode if decode == "torch" else phases[decode].decode,
                                            torch_prefill if prefill == "torch" else phases[prefill].prefill)
        if decode == "native":
            self._fused = native
            self._fused_rows = (_torch_dtype(dtype), layout.cache_shape[2:])

    def attend(self, q: Array, key_cache: Array, value_cache: Array, md: CPUAttentionMetadata,
               call: LayerCall) -> Array:
        """The contract's ``paged_attention`` of ``q`` ``[T, H, D]``; returns ``[T, H, D_v]`` in q's dtype."""
        if call.is_variant:  # under schedule_invariant torch's step takes every row as a prompt row too
            return self._variant(q, key_cache, value_cache, md.as_prompt_rows() if self._schedule_invariant else md,
                                 call)
        return self._step(q, key_cache, value_cache, md, call)

    def write(self, key_cache: Array, value_cache: Array, k: Array, v: Array, slot_mapping: Array) -> None:
        """The contract's ``write_kv``: rows ``[T, H_kv, D]`` to ``slot_mapping`` ``[T]``, in place."""
        self._store(key_cache, value_cache, k, v, slot_mapping)

    def write_and_attend(self, q: Array, k: Optional[Array], v: Optional[Array], key_cache: Array,
                         value_cache: Array, md: CPUAttentionMetadata, call: LayerCall, write: bool = True) -> Array:
        """:meth:`write` of ``k``/``v`` to ``md.slot_mapping`` (unless ``write`` is False),
        then :meth:`attend`. A decode-only step the native kernels take runs both in one
        call: per layer the hot path of a decode step."""
        fused = self._fused
        if fused is not None and fused.fits(q, k, v, md, call, write, *self._fused_rows):
            return fused.write_and_decode(q, k, v, key_cache, value_cache, md, call, write)
        if write:
            self._store(key_cache, value_cache, k, v, _slots_of(md))
        return self.attend(q, key_cache, value_cache, md, call)


def choose_store(cache: CacheLayout) -> Store:
    """The K/V store of these caches: the native row store, else numba's, for caches the
    kernels read; else torch's ``index_copy_`` (numpy caches: the reference's). Quantized
    caches: the native quantizing store where the library has it, else the numpy encoder
    and a byte scatter (the same bytes)."""
    fmt = cache.cache_format
    if not cache.tensors:
        from kvpage.attention.reference import write_kv_reference

        return write_kv_reference if fmt is None else functools.partial(write_kv_reference, cache_format=fmt)
    from kvpage.attention import cpu_kernels

    lib = _native_library()
    if fmt is not None:
        return cpu_kernels.QuantizedStore(lib if cache.kernel_readable else None, fmt).store
    if cache.kernel_readable and lib is not None:
        return cpu_kernels.NativeKernels(lib, cache.dtype).store
    if cache.kernel_readable and _numba_available():
        return cpu_kernels.NumbaKernels(cache.dtype).store
    return cpu_kernels.torch_store


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _slots_of(md: Optional[CPUAttentionMetadata]) -> Array:
    if md is None or md.slot_mapping is None:
        raise ValueError("pass slot_mapping, or metadata built with slot_mapping")
    return md.slot_mapping


def _numba_numpy_step(q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> np.ndarray:
    from kvpage.attention.numba_cpu import paged_attention_numba

    out = paged_attention_numba(q, key_cache, value_cache, md.query_start_loc, md.seq_lens, md.block_tables,
                                call.scaling, call.sliding_window, call.softcap, call.sinks,
                                num_decodes=md.num_decodes, work=md.work)
    return out.astype(q.dtype, copy=False)


def _reference_step(q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall,
                    cache_format: Optional[CacheFormat] = None) -> np.ndarray:
    from kvpage.attention.reference import paged_attention_reference

    return paged_attention_reference(q, key_cache, value_cache, md.query_start_loc, md.seq_lens, md.block_tables,
                                     call.scaling, call.sliding_window, call.softcap, call.sinks,
                                     attention_chunk=call.attention_chunk, alibi_slopes=call.alibi_slopes,
                                     cache_format=cache_format)


@dataclass(slots=True)
class _Site:
    """A bound site: its buffers (weakly, so a freed KV cache is not kept) and q's type."""

    key_cache: weakref.ref
    value_cache: weakref.ref
    q_type: tuple
    kernels: CPUKernels


@dataclass(slots=True)
class CPUAttention:
    """One model's CPU attention: each site's :class:`CPUKernels`, bound on the site's first
    call (sites of one layout share them) and found again by the identity of its K/V
    buffers, which live as long as the model's KV cache. ``cache_format``: the format of
    every buffer (:class:`~kvpage.core.kv_formats.CacheFormat`; None or unquantized: values
    of the buffers' dtype; quantized: uint8 ``[num_blocks, block_bytes]`` buffers)."""

    choice: CPUKernelChoice = field(default_factory=CPUKernelChoice)
    cache_format: Optional[CacheFormat] = None
    _sites: dict = field(default_factory=dict, init=False, repr=False)  # id(key buffer) -> _Site
    _stores: dict = field(default_factory=dict, init=False, repr=False)  # id(key buffer) -> (ref, ref, Store)
    _by_layout: dict = field(default_factory=dict, init=False, repr=False)  # AttentionLayout -> CPUKernels

    def kernels(self, q: Array, key_cache: Array, value_cache: Array) -> CPUKernels:
        """The kernels of the site whose buffers these are, for q of this type."""
        site = self._sites.get(id(key_cache))
        q_type = (q.dtype, q.shape[1:])
        if (site is None or site.key_cache() is not key_cache or site.value_cache() is not value_cache
                or site.q_type != q_type):
            layout = AttentionLayout.of(q, key_cache, value_cache, self.cache_format)
            kernels = self._by_layout.get(layout)
            if kernels is None:
                kernels = self._by_layout[layout] = CPUKernels(layout, self.choice)
            site = _Site(weakref.ref(key_cache), weakref.ref(value_cache), q_type, kernels)
            self._sites[id(key_cache)] = site
        return site.kernels

    def store(self, key_cache: Array, value_cache: Array) -> Store:
        """The K/V store of these buffers (:func:`choose_store`)."""
        entry = self._stores.get(id(key_cache))
        if entry is None or entry[0]() is not key_cache or entry[1]() is not value_cache:
            store = choose_store(CacheLayout.of(key_cache, value_cache, self.cache_format))
            entry = self._stores[id(key_cache)] = (weakref.ref(key_cache), weakref.ref(value_cache), store)
        return entry[2]


def paged_attention_cpu(q: Array, key_cache: Array, value_cache: Array, query_start_loc: Optional[Array] = None,
                        seq_lens: Optional[Array] = None, block_tables: Optional[Array] = None,
                        scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                        softcap: Optional[float] = None, sinks: Optional[Array] = None, *,
                        metadata: Optional[CPUAttentionMetadata] = None, decode_backend: Optional[str] = None,
                        prefill_backend: Optional[str] = None, attention_chunk: Optional[int] = None,
                        alibi_slopes: Optional[Array] = None, cache_format: Optional[CacheFormat] = None) -> Array:
    """The contract's ``paged_attention``, kernels bound for this one call.

    Pass either the three index arrays (numpy or torch) or ``metadata=`` (built once per
    step). ``decode_backend``/``prefill_backend`` override :class:`CPUKernelChoice`'s
    defaults; ``cache_format`` is the buffers' (:class:`CPUAttention`'s); the other
    arguments are :class:`~kvpage.attention.cpu_metadata.LayerCall`'s.
    """
    if scaling is None:
        raise ValueError("scaling is required")
    if metadata is None:
        if query_start_loc is None or seq_lens is None or block_tables is None:
            raise ValueError("pass query_start_loc, seq_lens and block_tables, or metadata=")
        metadata = prepare_cpu_attention_metadata(query_start_loc, seq_lens, block_tables)
    defaults = CPUKernelChoice()
    choice = CPUKernelChoice(decode_backend or defaults.decode_backend, prefill_backend or defaults.prefill_backend)
    call = LayerCall(scaling, sliding_window, softcap, sinks, attention_chunk, alibi_slopes)
    kernels = CPUKernels(AttentionLayout.of(q, key_cache, value_cache, cache_format), choice)
    return kernels.attend(q, key_cache, value_cache, metadata, call)


def write_kv_cpu(key_cache: Array, value_cache: Array, k: Array, v: Array, slot_mapping: Optional[Array] = None, *,
                 metadata: Optional[CPUAttentionMetadata] = None, cache_format: Optional[CacheFormat] = None) -> None:
    """The contract's ``write_kv`` (torch tensors or numpy arrays), in place, store bound for
    this one call; slots come from ``slot_mapping`` or ``metadata.slot_mapping``."""
    slots = _slots_of(metadata) if slot_mapping is None else slot_mapping
    choose_store(CacheLayout.of(key_cache, value_cache, cache_format))(key_cache, value_cache, k, v, slots)


def write_and_attend_cpu(q: Array, k: Optional[Array], v: Optional[Array], key_cache: Array, value_cache: Array,
                         scaling: float, sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                         sinks: Optional[Array] = None, *, metadata: CPUAttentionMetadata, write: bool = True,
                         choice: CPUKernelChoice = CPUKernelChoice(),
                         cache_format: Optional[CacheFormat] = None) -> Array:
    """:meth:`CPUKernels.write_and_attend` under ``choice`` (default: the defaults), kernels
    bound for this one call."""
    kernels = CPUKernels(AttentionLayout.of(q, key_cache, value_cache, cache_format), choice)
    return kernels.write_and_attend(q, k, v, key_cache, value_cache, metadata,
                                    LayerCall(scaling, sliding_window, softcap, sinks), write)


def kv_layouts_differ(key_cache: Array, value_cache: Array) -> bool:
    """True when K and V rows differ in heads or head size (then only torch serves them)."""
    return tuple(key_cache.shape[2:]) != tuple(value_cache.shape[2:])


def cpu_kernels_summary(dtype_name: str, head_dims, kv_cache_format: Optional[str] = None) -> str:
    """Which kernels CPU attention of this KV dtype and these head sizes runs on, in words
    (the start-up report): native (which variant) or numba, and whether prefill uses AMX.
    ``kv_cache_format``: the ``kv_cache_dtype`` (None: ``auto``); a quantized one is read by
    the native kernels where they take it, else by torch."""
    from kvpage.kernels import native_cpu

    lib = native_cpu.library()
    fmt = resolve_kv_format(kv_cache_format, dtype_name) if kv_cache_format not in (None, "auto") else None
    if fmt is not None and fmt.quantized:
        native = lib is not None and fmt.name in getattr(native_cpu, "CACHE_FORMATS", {}) and all(
            native_cpu.decode_supported(int(d), 1, 1, dtype_name, cache_format=fmt.name) for d in set(head_dims))
        where = "native" if native else "torch"
        return f"{fmt.name} KV cache read by the {where} kernels"
    if lib is None:
        return "numba kernels (native ones unavailable)"
    amx = dtype_name in native_cpu.ELEM_TYPES and any(
        native_cpu.prefill_uses_amx(lib, dtype_name, int(d)) for d in set(head_dims))
    isa = {"avx512": "AVX-512", "avx2": "AVX2"}[native_cpu.variant()]
    return f"native {isa} kernels" + (", bf16 prefill on AMX tiles" if amx else "")
