"""What CPU attention's kernel choice reads off a site, and the choice itself.

A site's layout (:class:`AttentionLayout`: q's element type, heads and head size over its
:class:`CacheLayout`) is fixed for the model's life, so :class:`~kvpage.attention.cpu.CPUKernels`
binds its kernels once per layout under a :class:`CPUKernelChoice` (:func:`choose_kernels`).
A quantized cache (``cache_format`` a quantized :class:`~kvpage.core.kv_formats.CacheFormat`)
is uint8 ``[num_blocks, block_bytes]`` buffers; its logical shape ``(num_blocks, block_size,
H_kv, D)`` follows from q's head size. Torch-free at import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from kvpage.attention.cpu_metadata import is_torch, kernel_dtype_name
from kvpage.attention.reference import check_same_rows, quantized
from kvpage.core.kv_formats import CacheFormat

if TYPE_CHECKING:
    from kvpage.attention.cpu_metadata import Array

#: The numba decode kernel is specialized per head size through tuple-length types, and
#: numba's parallel loops cannot carry tuples much longer than this: larger heads (Gemma4's
#: 512-wide global layers) decode on torch.
NUMBA_DECODE_MAX_HEAD_DIM = 256
BACKENDS = ("native", "numba", "torch")


@dataclass(frozen=True, slots=True)
class CPUKernelChoice:
    """Which backend each phase of torch inputs asks for: ``"native"`` (the C++ kernels of
    :mod:`kvpage.kernels.native_cpu`), ``"numba"`` or ``"torch"``. Where the asked one
    cannot serve a layout, :func:`choose_kernels` falls back."""

    decode_backend: str = "native"
    prefill_backend: str = "native"
    #: Decode rows take the prefill phase's kernel too, so that a row has the bits it gets
    #: inside a prompt however the step was scheduled (the native decode kernel sums in
    #: another order than the prefill kernel). ``EngineConfig.batch_invariant`` sets it.
    schedule_invariant: bool = False

    def __post_init__(self) -> None:
        for backend in (self.decode_backend, self.prefill_backend):
            if backend not in BACKENDS:
                raise ValueError(f"unknown CPU attention backend {backend!r}; expected one of {BACKENDS}")


def _is_bytes(dtype) -> bool:
    return str(dtype) in ("uint8", "torch.uint8")


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """What the kernel choice reads off a site's K/V buffers: ``[num_blocks, block_size,
    heads, head_dim]`` values, or (``cache_format`` set: quantized) uint8 ``[num_blocks,
    block_bytes]`` bytes of one shape for K and V."""

    tensors: bool  # torch tensors (else numpy arrays)
    dtype: Optional[str]  # their kernel element type; None where K and V differ, no kernel reads it, or quantized
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    kernel_readable: bool  # both contiguous in CPU memory, of a kernel element type or quantized bytes
    cache_format: Optional[CacheFormat] = None  # a quantized format; None for values

    @classmethod
    def of(cls, key_cache: Array, value_cache: Array, cache_format: Optional[CacheFormat] = None) -> "CacheLayout":
        """Raises ``ValueError`` (one line) where the buffers do not hold ``cache_format``."""
        fmt = quantized(cache_format)
        tensors = is_torch(key_cache)
        if tensors:
            contiguous = (key_cache.device.type == "cpu" and key_cache.is_contiguous()
                          and value_cache.is_contiguous())
        else:
            contiguous = key_cache.flags.c_contiguous and value_cache.flags.c_contiguous
        k_shape, v_shape = tuple(key_cache.shape), tuple(value_cache.shape)
        if fmt is not None:
            if not (_is_bytes(key_cache.dtype) and _is_bytes(value_cache.dtype) and len(k_shape) == 2):
                raise ValueError(f"kv_cache_dtype {fmt.kv_format.name} stores uint8 [num_blocks, block_bytes] "
                                 f"buffers, not {key_cache.dtype} {k_shape}")
            check_same_rows(k_shape, v_shape, fmt)
            return cls(tensors, None, k_shape, v_shape, bool(contiguous), fmt)
        if _is_bytes(key_cache.dtype):
            raise ValueError("uint8 KV buffers hold a quantized format: pass its cache_format")
        same = key_cache.dtype == value_cache.dtype
        dtype = kernel_dtype_name(key_cache.dtype) if same else None
        return cls(tensors, dtype, k_shape, v_shape, bool(contiguous) and dtype is not None)

    @property
    def kv_differ(self) -> bool:
        """K and V rows differ in heads or head size (MLA): only torch and the reference read them."""
        return self.k_shape[2:] != self.v_shape[2:]


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """A site's q (element type, heads, head size) over its :class:`CacheLayout`;
    ``cache_shape`` is the K buffer's ``(num_blocks, block_size, H_kv, D)`` (a quantized
    one's logical shape)."""

    q_dtype: Optional[str]
    num_heads: int
    head_dim: int
    cache: CacheLayout
    cache_shape: tuple[int, ...]

    @classmethod
    def of(cls, q: Array, key_cache: Array, value_cache: Array,
           cache_format: Optional[CacheFormat] = None) -> "AttentionLayout":
        cache = CacheLayout.of(key_cache, value_cache, cache_format)
        head_dim = int(q.shape[2])
        shape = cache.k_shape if cache.cache_format is None else cache.cache_format.logical_shape(cache.k_shape,
                                                                                                  head_dim)
        return cls(kernel_dtype_name(q.dtype), int(q.shape[1]), head_dim, cache, tuple(shape))

    def native_fits(self) -> bool:
        """Whether the native kernels take this layout (given the library loads)."""
        from kvpage.kernels import native_cpu

        cache = self.cache
        if not (cache.tensors and cache.kernel_readable and not cache.kv_differ):
            return False
        if cache.cache_format is None:
            return self.q_dtype == cache.dtype and native_cpu.decode_supported(
                self.head_dim, self.num_heads, cache.k_shape[2], cache.dtype)
        name = cache.cache_format.kv_format.name
        return (self.q_dtype is not None and name in getattr(native_cpu, "CACHE_FORMATS", {})
                and native_cpu.decode_supported(self.head_dim, self.num_heads, self.cache_shape[2], self.q_dtype,
                                                cache_format=native_format(cache.cache_format)))


def native_format(cache_format: Optional[CacheFormat]):
    """What the native kernels' ``cache_format=`` takes for a quantized format: its name
    (a key of ``native_cpu.CACHE_FORMATS``); None unquantized."""
    fmt = quantized(cache_format)
    return None if fmt is None else fmt.kv_format.name


def choose_kernels(layout: AttentionLayout, choice: CPUKernelChoice, native: bool, numba: bool) -> tuple[str, str]:
    """The (decode, prefill) backends of a layout: ``"native"``, ``"numba"``, ``"torch"``,
    or for numpy inputs ``"numba"`` / ``"reference"`` (both phases alike).

    ``native``/``numba``: whether the library loads and numba imports on this machine.
    K and V of different shapes, and a machine without numba, take torch (numpy: the
    reference); heads wider than :data:`NUMBA_DECODE_MAX_HEAD_DIM` decode on torch. Torch
    inputs: a native phase the native kernels cannot serve becomes numba (decode) or torch
    (prefill), as does a numba phase over caches the kernels cannot read; a numba prefill
    makes a native decode numba too (one numba call serves both). Quantized caches never
    take numba: a phase is native where asked and the native kernels take the format, else
    torch (numpy inputs: the reference). Under ``schedule_invariant`` decode names the
    prefill's backend, whose prefill phase then computes every row of a step.
    """
    cache = layout.cache
    if cache.cache_format is not None:
        if not cache.tensors:
            return "reference", "reference"
        fits = native and layout.native_fits()
        decode, prefill = ("native" if asked == "native" and fits else "torch"
                           for asked in (choice.decode_backend, choice.prefill_backend))
        return (prefill, prefill) if choice.schedule_invariant else (decode, prefill)
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
    return (prefill, prefill) if choice.schedule_invariant else (decode, prefill)
