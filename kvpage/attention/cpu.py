"""CPU paged attention: each attention site's kernels are chosen once, then called per step.

Contract: the one in :mod:`kvpage.attention` (``write_kv`` and ``paged_attention``, same
masks, softcap, sinks, chunked attention, ALiBi and GQA rule as the reference), on torch
CPU tensors or numpy arrays; results come back in q's kind and dtype, ``[T, H, D_v]``.

* :class:`CPUKernels` binds the kernels of one :class:`AttentionLayout` (what a site's
  q and K/V buffers fix for the model's life: element types, head counts and sizes,
  contiguity) under a :class:`CPUKernelChoice` and this machine's features (the native
  library, numba): a decode kernel, a prefill kernel, a K/V store, and the fused native
  write-and-decode where it serves. :func:`choose_kernels` states the rules. Per call it
  reads only the step's :class:`~kvpage.attention.cpu_metadata.CPUAttentionMetadata`
  (built once per step) and the layer's :class:`~kvpage.attention.cpu_metadata.LayerCall`.
* :class:`CPUAttention` is one model's set: a site's kernels are bound on its first call
  and found again by the identity of its K/V buffers.
* :func:`paged_attention_cpu`, :func:`write_kv_cpu` and :func:`write_and_attend_cpu` bind
  per call: for tests, benchmarks and one-off callers, not for a model's steps.

Import is torch- and numba-free; the backends load when a layout is bound.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from kvpage.attention.cpu_metadata import (CPUAttentionMetadata, LayerCall, is_torch, kernel_dtype_name,
                                           prepare_cpu_attention_metadata)

if TYPE_CHECKING:
    from kvpage.attention.cpu_metadata import Array

#: The numba decode kernel is specialized per head size through tuple-length types, and
#: numba's parallel loops cannot carry tuples much longer than this: larger heads (Gemma4's
#: 512-wide global layers) decode on torch.
NUMBA_DECODE_MAX_HEAD_DIM = 256
BACKENDS = ("native", "numba", "torch")

#: ``store(key_cache, value_cache, k, v, slot_mapping)``: the contract's ``write_kv``.
Store = Callable[..., None]


@dataclass(frozen=True, slots=True)
class CPUKernelChoice:
    """Which backend each phase of torch inputs asks for: ``"native"`` (the C++ kernels of
    :mod:`kvpage.kernels.native_cpu`), ``"numba"`` or ``"torch"``. Where the asked one
    cannot serve a layout, :func:`choose_kernels` falls back."""

    decode_backend: str = "native"
    prefill_backend: str = "native"

    def __post_init__(self) -> None:
        for backend in (self.decode_backend, self.prefill_backend):
            if backend not in BACKENDS:
                raise ValueError(f"unknown CPU attention backend {backend!r}; expected one of {BACKENDS}")


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """What the kernel choice reads off a site's K/V buffers ``[num_blocks, block_size, heads, head_dim]``."""

    tensors: bool  # torch tensors (else numpy arrays)
    dtype: Optional[str]  # their kernel element type; None where K and V differ or no kernel reads it
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    kernel_readable: bool  # both contiguous in CPU memory, of a kernel element type (native, numba)

    @classmethod
    def of(cls, key_cache: Array, value_cache: Array) -> "CacheLayout":
        tensors = is_torch(key_cache)
        same = key_cache.dtype == value_cache.dtype
        dtype = kernel_dtype_name(key_cache.dtype) if same else None
        if tensors:
            contiguous = (key_cache.device.type == "cpu" and key_cache.is_contiguous()
                          and value_cache.is_contiguous())
        else:
            contiguous = key_cache.flags.c_contiguous and value_cache.flags.c_contiguous
        return cls(tensors, dtype, tuple(key_cache.shape), tuple(value_cache.shape),
                   bool(contiguous) and dtype is not None)

    @property
    def kv_differ(self) -> bool:
        """K and V rows differ in heads or head size (MLA): only torch and the reference read them."""
        return self.k_shape[2:] != self.v_shape[2:]


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """A site's q (element type, heads, head size) over its :class:`CacheLayout`."""

    q_dtype: Optional[str]
    num_heads: int
    head_dim: int
    cache: CacheLayout

    @classmethod
    def of(cls, q: Array, key_cache: Array, value_cache: Array) -> "AttentionLayout":
        return cls(kernel_dtype_name(q.dtype), int(q.shape[1]), int(q.shape[2]),
                   CacheLayout.of(key_cache, value_cache))

    def native_fits(self) -> bool:
        """Whether the native kernels take this layout (given the library loads)."""
        from kvpage.kernels import native_cpu

        cache = self.cache
        return (cache.tensors and cache.kernel_readable and not cache.kv_differ and self.q_dtype == cache.dtype
                and native_cpu.decode_supported(self.head_dim, self.num_heads, cache.k_shape[2], cache.dtype))


def choose_kernels(layout: AttentionLayout, choice: CPUKernelChoice, native: bool, numba: bool) -> tuple[str, str]:
    """The (decode, prefill) backends of a layout: ``"native"``, ``"numba"``, ``"torch"``,
    or for numpy inputs ``"numba"`` / ``"reference"`` (both phases alike).

    ``native``/``numba``: whether the library loads and numba imports on this machine.
    K and V of different shapes, and a machine without numba, take torch (numpy: the
    reference); heads wider than :data:`NUMBA_DECODE_MAX_HEAD_DIM` decode on torch. Torch
    inputs: a native phase the native kernels cannot serve becomes numba (decode) or torch
    (prefill), as does a numba phase over caches the kernels cannot read; a numba prefill
    makes a native decode numba too (one numba call serves both).
    """
    cache = layout.cache
    decode, prefill = choice.decode_backend, choice.prefill_backend
    if not numba or cache.kv_differ:
        decode = prefill = "torch"
    if layout.head_dim > NUMBA_DECODE_MAX_HEAD_DIM:
        decode = "torch"
    if not cache.tensors:  # numba, or the numpy oracle where numba cannot serve
        return ("reference", "reference") if decode == "torch" else ("numba", "numba")
    if not (native and layout.native_fits()):
        decode = "numba" if decode == "native" else decode
        prefill = "torch" if prefill == "native" else prefill
    elif decode == "native" and prefill == "numba":
        decode = "numba"
    if not cache.kernel_readable:
        decode = "torch" if decode == "numba" else decode
        prefill = "torch" if prefill == "numba" else prefill
    return decode, prefill


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

    __slots__ = ("layout", "decode_backend", "prefill_backend", "_step", "_variant", "_store", "_fused",
                 "_fused_rows")

    def __init__(self, layout: AttentionLayout, choice: CPUKernelChoice = CPUKernelChoice()) -> None:
        lib = _native_library() if layout.cache.tensors else None  # numpy inputs never take it
        self.layout = layout
        self.decode_backend, self.prefill_backend = choose_kernels(layout, choice, lib is not None,
                                                                   _numba_available())
        self._store = choose_store(layout.cache)
        self._fused = self._fused_rows = None
        if not layout.cache.tensors:
            self._step = _numba_numpy_step if self.decode_backend == "numba" else _reference_step
            self._variant = _reference_step
        else:
            self._bind_torch(lib)

    def _bind_torch(self, lib) -> None:
        from kvpage.attention import cpu_kernels as kernels

        decode, prefill, dtype = self.decode_backend, self.prefill_backend, self.layout.cache.dtype
        native = kernels.NativeKernels(lib, dtype) if "native" in (decode, prefill) else None
        numba = kernels.NumbaKernels(dtype) if "numba" in (decode, prefill) else None
        self._variant = kernels.torch_step
        if decode == prefill == "torch":
            self._step = kernels.torch_step
        elif decode == prefill == "numba":
            self._step = numba.step
        else:
            phases = {"native": native, "numba": numba}
            self._step = kernels.PhasedStep(
                kernels.torch_decode if decode == "torch" else phases[decode].decode,
                kernels.torch_prefill if prefill == "torch" else phases[prefill].prefill)
        if decode == "native":
            self._fused = native
            self._fused_rows = (_torch_dtype(dtype), self.layout.cache.k_shape[2:])

    def attend(self, q: Array, key_cache: Array, value_cache: Array, md: CPUAttentionMetadata,
               call: LayerCall) -> Array:
        """The contract's ``paged_attention`` of ``q`` ``[T, H, D]``; returns ``[T, H, D_v]`` in q's dtype."""
        if call.is_variant:
            return self._variant(q, key_cache, value_cache, md, call)
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
    kernels read; else torch's ``index_copy_`` (numpy caches: the reference's)."""
    if not cache.tensors:
        from kvpage.attention.reference import write_kv_reference

        return write_kv_reference
    from kvpage.attention import cpu_kernels

    lib = _native_library()
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


def _reference_step(q, key_cache, value_cache, md: CPUAttentionMetadata, call: LayerCall) -> np.ndarray:
    from kvpage.attention.reference import paged_attention_reference

    return paged_attention_reference(q, key_cache, value_cache, md.query_start_loc, md.seq_lens, md.block_tables,
                                     call.scaling, call.sliding_window, call.softcap, call.sinks,
                                     attention_chunk=call.attention_chunk, alibi_slopes=call.alibi_slopes)


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
    buffers, which live as long as the model's KV cache."""

    choice: CPUKernelChoice = field(default_factory=CPUKernelChoice)
    _sites: dict = field(default_factory=dict, init=False, repr=False)  # id(key buffer) -> _Site
    _stores: dict = field(default_factory=dict, init=False, repr=False)  # id(key buffer) -> (ref, ref, Store)
    _by_layout: dict = field(default_factory=dict, init=False, repr=False)  # AttentionLayout -> CPUKernels

    def kernels(self, q: Array, key_cache: Array, value_cache: Array) -> CPUKernels:
        """The kernels of the site whose buffers these are, for q of this type."""
        site = self._sites.get(id(key_cache))
        q_type = (q.dtype, q.shape[1:])
        if (site is None or site.key_cache() is not key_cache or site.value_cache() is not value_cache
                or site.q_type != q_type):
            layout = AttentionLayout.of(q, key_cache, value_cache)
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
            store = choose_store(CacheLayout.of(key_cache, value_cache))
            entry = self._stores[id(key_cache)] = (weakref.ref(key_cache), weakref.ref(value_cache), store)
        return entry[2]


def paged_attention_cpu(q: Array, key_cache: Array, value_cache: Array, query_start_loc: Optional[Array] = None,
                        seq_lens: Optional[Array] = None, block_tables: Optional[Array] = None,
                        scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                        softcap: Optional[float] = None, sinks: Optional[Array] = None, *,
                        metadata: Optional[CPUAttentionMetadata] = None, decode_backend: Optional[str] = None,
                        prefill_backend: Optional[str] = None, attention_chunk: Optional[int] = None,
                        alibi_slopes: Optional[Array] = None) -> Array:
    """The contract's ``paged_attention``, kernels bound for this one call.

    Pass either the three index arrays (numpy or torch) or ``metadata=`` (built once per
    step). ``decode_backend``/``prefill_backend`` override :class:`CPUKernelChoice`'s
    defaults; the other arguments are :class:`~kvpage.attention.cpu_metadata.LayerCall`'s.
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
    return CPUKernels(AttentionLayout.of(q, key_cache, value_cache), choice).attend(q, key_cache, value_cache,
                                                                                   metadata, call)


def write_kv_cpu(key_cache: Array, value_cache: Array, k: Array, v: Array, slot_mapping: Optional[Array] = None, *,
                 metadata: Optional[CPUAttentionMetadata] = None) -> None:
    """The contract's ``write_kv`` (torch tensors or numpy arrays), in place, store bound for
    this one call; slots come from ``slot_mapping`` or ``metadata.slot_mapping``."""
    slots = _slots_of(metadata) if slot_mapping is None else slot_mapping
    choose_store(CacheLayout.of(key_cache, value_cache))(key_cache, value_cache, k, v, slots)


def write_and_attend_cpu(q: Array, k: Optional[Array], v: Optional[Array], key_cache: Array, value_cache: Array,
                         scaling: float, sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                         sinks: Optional[Array] = None, *, metadata: CPUAttentionMetadata, write: bool = True) -> Array:
    """:meth:`CPUKernels.write_and_attend` with the default choice, kernels bound for this one call."""
    kernels = CPUKernels(AttentionLayout.of(q, key_cache, value_cache))
    return kernels.write_and_attend(q, k, v, key_cache, value_cache, metadata,
                                    LayerCall(scaling, sliding_window, softcap, sinks), write)


def kv_layouts_differ(key_cache: Array, value_cache: Array) -> bool:
    """True when K and V rows differ in heads or head size (then only torch serves them)."""
    return tuple(key_cache.shape[2:]) != tuple(value_cache.shape[2:])


def cpu_kernels_summary(dtype_name: str, head_dims) -> str:
    """Which kernels CPU attention of this KV dtype and these head sizes runs on, in words
    (the start-up report): native (which variant) or numba, and whether prefill uses AMX."""
    from kvpage.kernels import native_cpu

    lib = native_cpu.library()
    if lib is None:
        return "numba kernels (native ones unavailable)"
    amx = dtype_name in native_cpu.ELEM_TYPES and any(
        native_cpu.prefill_uses_amx(lib, dtype_name, int(d)) for d in set(head_dims))
    isa = {"avx512": "AVX-512", "avx2": "AVX2"}[native_cpu.variant()]
    return f"native {isa} kernels" + (", bf16 prefill on AMX tiles" if amx else "")
