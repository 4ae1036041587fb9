"""Native CPU kernels: paged attention, KV row stores, logits argmax.

Two variants of one C interface: ``native_cpu.cpp`` for CPUs with AVX-512F and
``native_cpu_avx2.cpp`` for CPUs with AVX2, FMA and F16C but no AVX-512 (both include
``native_cpu_common.h``, ``native_cpu_quant*.h`` and ``native_cpu_api.h``). The one the CPU
runs is built on first use with the system C++ compiler (``g++ -O3 -march=native
-fopenmp``, the toolchain ``torch.compile`` already needs on CPU) into
``$KVPAGE_CACHE/native/<hash>/`` (``~/.cache/kvpage``), keyed by the sources, the compiler
and the CPU's flags, so later processes load it in milliseconds; loaded with ctypes. Torch-free: arguments are raw
addresses and sizes, so numpy arrays and torch tensors both work
(:mod:`kvpage.attention.cpu_kernels` passes torch tensors' addresses).

Why it exists (measured, see the sources' headers): the library links GNU OpenMP by
soname and so shares torch's thread pool, where numba's parallel loops ran on a second
copy of libgomp whose pool fought torch's for the cores at every layer; and one ctypes
call replaces a numba dispatch of about twenty arguments.

:func:`library` returns None, and the callers keep the numba kernels, when the CPU has
neither AVX-512F nor AVX2+FMA+F16C, no compiler is found, the build fails (logged once),
or ``KVPAGE_NATIVE_KERNELS=0``. ``KVPAGE_NATIVE_KERNELS=avx2`` takes the AVX2 variant on
an AVX-512 CPU too (to test or compare it).

Quantized KV caches (``cache_format`` one of fp8_e4m3, fp8_e5m2, int8, int4; the byte layouts
of :mod:`kvpage.core.kv_formats`) are read and written natively: :func:`store_quantized`
(and :func:`write_decode`) quantize rows byte for byte as
:func:`kvpage.kernels.kv_quant.quantize_rows`, and decode and prefill attention convert codes
to fp32 in registers, folding the scales into scores and weights (``native_cpu_quant.h``);
q and the output stay in the model's dtype. A ``cache_format`` argument is a format name, a
:class:`~kvpage.core.kv_formats.KVFormat` or a :class:`~kvpage.core.kv_formats.CacheFormat`;
None (or q's own dtype) means the caches hold q's dtype, as before.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import numpy as np

log = logging.getLogger("kvpage")

_HERE = Path(__file__).parent
#: The kernel source of each variant, best first, and the CPU flags it needs.
VARIANTS = {"avx512": (_HERE / "native_cpu.cpp", ("avx512f",)),
            "avx2": (_HERE / "native_cpu_avx2.cpp", ("avx2", "fma", "f16c"))}
_HEADERS = (_HERE / "native_cpu_common.h", _HERE / "native_cpu_quant.h", _HERE / "native_cpu_quant_int4.h",
            _HERE / "native_cpu_quant_decode.h", _HERE / "native_cpu_quant_transposed.h",
            _HERE / "native_cpu_quant_prefill.h", _HERE / "native_cpu_api.h")
ABI_VERSION = 7
#: Element types the kernels take, by numpy/torch dtype name (the C ``elem_type`` codes).
ELEM_TYPES = {"float32": 0, "float16": 1, "bfloat16": 2}
#: Cache formats the kernels read, by name (the C ``cache_format`` codes): the element types
#: (the caches hold q's dtype) and the quantized formats of :mod:`kvpage.core.kv_formats`.
CACHE_FORMATS = {"float32": 0, "float16": 1, "bfloat16": 2, "fp8_e4m3": 3, "fp8_e5m2": 4, "int8": 5, "int4": 6}
_FORMAT_NAMES = {code: name for name, code in CACHE_FORMATS.items()}
_ALIASES = {"fp8": "fp8_e4m3"}
#: Largest head size the decode kernel takes (16 chunks of 16 floats), and its multiple.
MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 256, 16
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno"]

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build(compiler: str, source: Path) -> Path:
    """Compile ``source`` (once per sources/compiler/CPU) and return the library's path."""
    from kvpage.platform.paths import cache_root

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    texts = [path.read_text() for path in (source, *_HEADERS)]
    key = hashlib.sha256("\0".join([*texts, compiler, version, " ".join(_FLAGS), _cpu_flags()]).encode())
    target = cache_root() / "native" / key.hexdigest()[:16] / "kvpage_native.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        proc = subprocess.run([compiler, *_FLAGS, str(source), "-o", str(built)], capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip()[-2000:] or f"{compiler} exited with {proc.returncode}")
        os.replace(built, target)  # atomic: concurrent builders leave one complete file
    log.info("built kvpage's native CPU kernels: %s", target)
    return target


def variant() -> Optional[str]:
    """The kernel variant this CPU runs (a key of :data:`VARIANTS`), or None: the best one
    whose flags the CPU has, unless ``KVPAGE_NATIVE_KERNELS`` is ``0`` (none) or names one."""
    wanted = os.environ.get("KVPAGE_NATIVE_KERNELS", "1")
    if wanted == "0":
        return None
    flags = set(_cpu_flags().split())
    for name, (_, needs) in VARIANTS.items():
        if wanted in ("1", name) and set(needs) <= flags:
            return name
    return None


# One build at a time: the engine builds the library in a thread of its own while the model
# compiles, and a caller on another thread waits for that build rather than starting one.
_BUILD_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None where they are unavailable (see the module docstring)."""
    with _BUILD_LOCK:
        return _load_library()


def _load_library() -> Optional[ctypes.CDLL]:
    name = variant()
    if name is None:
        return None
    compiler = _compiler()
    if compiler is None:
        log.info("no C++ compiler found: CPU attention stays on the numba kernels")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler, VARIANTS[name][0])))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("kvpage's native CPU kernels did not build (%s); CPU attention stays on the numba kernels",
                    str(err).splitlines()[-1] if str(err) else type(err).__name__)
        return None
    if lib.kvpage_native_abi() != ABI_VERSION:
        log.warning("stale native CPU kernel library (ABI %d, expected %d); using numba", lib.kvpage_native_abi(),
                    ABI_VERSION)
        return None
    lib.kvpage_decode_attention.restype = _i32
    lib.kvpage_decode_attention.argtypes = [_i32, _i32, _p, _i64, _i64, _p, _p, _i64, _i64, _i64, _i64, _p, _i64, _p,
                                            _i64, _f32, _i64, _f32, _p, _p, _i64, _i32]
    lib.kvpage_write_decode.restype = _i64
    lib.kvpage_write_decode.argtypes = [_i32, _i32, _p, _i64, _i64, _p, _i64, _i64, _p, _i64, _i64, _p, _i64, _p, _p,
                                        _i64, _i64, _i64, _i64, _i64, _p, _i64, _p, _i64, _f32, _i64, _f32, _p, _p,
                                        _i64, _i32]
    lib.kvpage_prefill_attention.restype = _i32
    lib.kvpage_prefill_attention.argtypes = [_i32, _i32, _p, _i64, _i64, _p, _p, _i64, _i64, _i64, _i64, _p, _i64, _p,
                                             _p, _i64, _i64, _f32, _i64, _f32, _p, _p, _i32]
    lib.kvpage_store_rows.restype = _i64
    lib.kvpage_store_rows.argtypes = [_p, _i64, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64]
    lib.kvpage_store_quantized.restype = _i64
    lib.kvpage_store_quantized.argtypes = [_i32, _p, _i64, _i64, _i64, _i64, _i32, _p, _i64, _i64, _p, _i64]
    lib.kvpage_row_argmax.restype = None
    lib.kvpage_row_argmax.argtypes = [_p, _i64, _i64, _i64, _p, _p, _i32]
    lib.kvpage_prefill_uses_amx.restype = _i32
    lib.kvpage_prefill_uses_amx.argtypes = [_i32, _i64]
    return lib


def format_name(cache_format) -> Optional[str]:
    """The :data:`CACHE_FORMATS` name of ``cache_format`` (None, a name, a ``KVFormat`` or a
    ``CacheFormat``), None for None; ``ValueError`` for a name the kernels do not know."""
    if cache_format is None:
        return None
    fmt = getattr(cache_format, "kv_format", cache_format)
    name = getattr(fmt, "name", fmt)
    name = _ALIASES.get(name, name)
    if name not in CACHE_FORMATS:
        raise ValueError(f"the native CPU kernels do not read KV cache format {name!r}; they read "
                         f"{', '.join(CACHE_FORMATS)}")
    return name


def _cache_code(dtype_name: str, cache_format, block_size: Optional[int] = None) -> int:
    """The C ``cache_format`` code of caches in ``cache_format`` read with q of ``dtype_name``
    (``ValueError`` for an unquantized format other than q's dtype, or a ``CacheFormat`` whose
    block size is not the cache's)."""
    name = format_name(cache_format) or dtype_name
    if name in ELEM_TYPES and name != dtype_name:
        raise ValueError(f"the native CPU kernels read {name} caches with {name} queries only, not {dtype_name}")
    fmt_block = getattr(cache_format, "block_size", None)
    if block_size is not None and fmt_block is not None and fmt_block != block_size:
        raise ValueError(f"cache format of blocks of {fmt_block} tokens for a cache of blocks of {block_size}")
    return CACHE_FORMATS[name]


def _format_note(code: int) -> str:
    """`` over <format> caches`` for a quantized format code, else nothing (error messages)."""
    return "" if code < len(ELEM_TYPES) else f" over {_FORMAT_NAMES[code]} caches"


def decode_supported(head_dim: int, num_heads: int, num_kv_heads: int, dtype_name: str, cache_format=None) -> bool:
    """Whether :func:`decode_attention` (and :func:`prefill_attention`) take these shapes, this
    element type of q and this cache format (any of :data:`CACHE_FORMATS` quantized, or q's
    own dtype; None: q's dtype)."""
    if not (dtype_name in ELEM_TYPES and head_dim % HEAD_DIM_MULTIPLE == 0 and 0 < head_dim <= MAX_HEAD_DIM
            and num_kv_heads > 0 and num_heads % num_kv_heads == 0):
        return False
    try:
        _cache_code(dtype_name, cache_format)
    except ValueError:
        return False
    return True


def decode_attention(lib: ctypes.CDLL, dtype_name: str, q_ptr: int, q_strides: tuple, key_ptr: int, value_ptr: int,
                     cache_shape: tuple, num_heads: int, tables: np.ndarray, seq_lens: np.ndarray, num_seqs: int,
                     scale: float, window: int, softcap: float, sinks: Optional[np.ndarray], out_ptr: int,
                     num_splits: int, num_threads: int, cache_format=None) -> None:
    """Decode attention of ``num_seqs`` query rows (one per sequence, its last context token).

    ``q`` (at ``q_ptr``, strides ``(token, head)`` in elements, head_dim contiguous) and the
    output (``[num_seqs, num_heads, D]``, contiguous) hold ``dtype_name`` elements; the
    caches (``cache_shape`` = ``[num_blocks, block_size, H_kv, D]``, contiguous) hold them
    too, or for a quantized ``cache_format`` are uint8 ``[num_blocks, block_bytes]`` buffers
    (``cache_shape`` is then the logical shape). ``tables`` int32 ``[>= num_seqs,
    max_blocks]`` C-contiguous rows, ``seq_lens`` int32; ``sinks`` float32 ``[num_heads]``
    or None. The caller keeps every array alive and checks :func:`decode_supported` first.
    """
    _, block_size, num_kv_heads, head_dim = cache_shape
    fmt = _cache_code(dtype_name, cache_format, block_size)
    code = lib.kvpage_decode_attention(
        ELEM_TYPES[dtype_name], fmt, q_ptr, q_strides[0], q_strides[1], key_ptr, value_ptr, block_size, num_kv_heads,
        head_dim, num_heads, tables.ctypes.data, tables.strides[0] // 4, seq_lens.ctypes.data, num_seqs, scale,
        window, softcap, None if sinks is None else sinks.ctypes.data, out_ptr, num_splits, num_threads)
    if code != 0:
        raise ValueError(f"native decode attention refused head_dim {head_dim} with {num_heads} query and "
                         f"{num_kv_heads} KV heads{_format_note(fmt)} (code {code})")


def prefill_uses_amx(lib: ctypes.CDLL, dtype_name: str, head_dim: int) -> bool:
    """Whether :func:`prefill_attention` of this element type and head size runs its scores
    and P.V on the AMX tile unit (the AVX-512 variant, bf16, head size 64/128/256, a CPU with
    AMX-BF16, Linux's grant of tile state, ``KVPAGE_AMX`` not ``0``); otherwise on vectors."""
    return bool(lib.kvpage_prefill_uses_amx(ELEM_TYPES[dtype_name], head_dim))


def prefill_attention(lib: ctypes.CDLL, dtype_name: str, q_ptr: int, q_strides: tuple, key_ptr: int, value_ptr: int,
                      cache_shape: tuple, num_heads: int, tables: np.ndarray, query_start_loc: np.ndarray,
                      seq_lens: np.ndarray, first_seq: int, scale: float, window: int, softcap: float,
                      sinks: Optional[np.ndarray], out_ptr: int, num_threads: int, cache_format=None) -> None:
    """Attention of the query rows of sequences ``first_seq:`` (each the last ``q_len``
    positions of its context; causal) into the same rows of the ``[T, num_heads, D]``
    contiguous output; earlier rows are left alone. Layouts and ``cache_format`` as
    :func:`decode_attention` (any block size); ``query_start_loc`` int32 ``[B + 1]``. The
    caller checks :func:`decode_supported`, which covers this kernel too. Quantized caches
    never take the AMX path (:func:`prefill_uses_amx` speaks of unquantized ones)."""
    _, block_size, num_kv_heads, head_dim = cache_shape
    fmt = _cache_code(dtype_name, cache_format, block_size)
    code = lib.kvpage_prefill_attention(
        ELEM_TYPES[dtype_name], fmt, q_ptr, q_strides[0], q_strides[1], key_ptr, value_ptr, block_size, num_kv_heads,
        head_dim, num_heads, tables.ctypes.data, tables.strides[0] // 4, query_start_loc.ctypes.data,
        seq_lens.ctypes.data, first_seq, seq_lens.shape[0], scale, window, softcap,
        None if sinks is None else sinks.ctypes.data, out_ptr, num_threads)
    if code != 0:
        raise ValueError(f"native prefill attention refused head_dim {head_dim} with {num_heads} query and "
                         f"{num_kv_heads} KV heads{_format_note(fmt)}, or more queries than context (code {code})")


def write_decode(lib: ctypes.CDLL, dtype_name: str, q: tuple, k: Optional[tuple], v: Optional[tuple], slots_ptr: int,
                 num_new: int, key_ptr: int, value_ptr: int, cache_shape: tuple, num_heads: int, step: tuple,
                 scale: float, window: int, softcap: float, sinks_ptr: Optional[int], out_ptr: int,
                 num_threads: int, cache_format=None) -> None:
    """Write ``num_new`` K/V rows to their slots, then :func:`decode_attention`, in one call.

    ``q``, ``k``, ``v`` are ``(address, token stride, head stride)`` in elements of
    ``dtype_name`` (head_dim contiguous); ``k`` None skips the write (a layer reading another
    layer's KV); a quantized ``cache_format`` quantizes the rows as :func:`store_quantized`.
    ``slots_ptr`` addresses ``num_new`` int64 slots; ``step`` is ``(tables address, table
    row stride, seq_lens address, num_seqs, num_splits)``. Raises ``IndexError`` (nothing
    written or attended) for a slot outside the cache.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache_shape
    tables_ptr, table_stride, lens_ptr, num_seqs, num_splits = step
    k, v = k or (None, 0, 0), v or (None, 0, 0)
    fmt = _cache_code(dtype_name, cache_format, block_size)
    code = lib.kvpage_write_decode(ELEM_TYPES[dtype_name], fmt, *q, *k, *v, slots_ptr, num_new, key_ptr, value_ptr,
                                   num_blocks, block_size, num_kv_heads, head_dim, num_heads, tables_ptr, table_stride,
                                   lens_ptr, num_seqs, scale, window, softcap, sinks_ptr, out_ptr, num_splits,
                                   num_threads)
    if code > 0:
        slot = ctypes.cast(slots_ptr, ctypes.POINTER(ctypes.c_int64))[code - 1]
        raise IndexError(f"KV slot {slot} outside the cache ({num_blocks * block_size} slots)")
    if code < 0:
        raise ValueError(f"native decode attention refused head_dim {head_dim} with {num_heads} query and "
                         f"{num_kv_heads} KV heads{_format_note(fmt)} (code {code})")


def store_rows(lib: ctypes.CDLL, cache_ptr: int, cache_shape: tuple, elem_bytes: int, rows_ptr: int,
               rows_strides: tuple, slots: np.ndarray) -> None:
    """``cache[slots[t]] = rows[t]`` for every slot of the int64 C-contiguous ``slots``: the
    cache ``[num_blocks, block_size, H_kv, D]`` contiguous, the rows ``[T, H_kv, D]`` with
    ``(token, head)`` strides in elements (head_dim contiguous), both of ``elem_bytes``
    elements. Raises ``IndexError`` before writing anything when a slot is outside the cache."""
    num_blocks, block_size, num_kv_heads, head_dim = cache_shape
    num_slots = num_blocks * block_size
    bad = lib.kvpage_store_rows(cache_ptr, num_slots, num_kv_heads, head_dim, elem_bytes, rows_ptr, rows_strides[0],
                                rows_strides[1], slots.ctypes.data, slots.shape[0])
    if bad:
        raise IndexError(f"KV slot {int(slots[bad - 1])} outside the cache ({num_slots} slots)")


def store_quantized(lib: ctypes.CDLL, cache_format, cache_ptr: int, cache_shape: tuple, rows_dtype_name: str,
                    rows_ptr: int, rows_strides: tuple, slots: np.ndarray) -> None:
    """Quantize ``rows[t]`` into the cache row of ``slots[t]`` for every slot of the int64
    C-contiguous ``slots``: the cache a uint8 ``[num_blocks, block_bytes]`` buffer of the
    quantized ``cache_format``, ``cache_shape`` its logical ``(num_blocks, block_size, H_kv,
    head_dim)``; the rows ``[T, H_kv, head_dim]`` of ``rows_dtype_name`` (float32, float16 or
    bfloat16) with ``(token, head)`` strides in elements, head_dim contiguous. The bytes are
    those of :func:`kvpage.kernels.kv_quant.quantize_rows` of the rows widened to float32.
    Raises ``IndexError`` before writing anything when a slot is outside the cache, and
    ``ValueError`` for an unquantized format, a row dtype or head size the kernel does not take
    (head_dim a multiple of 16 up to 256)."""
    num_blocks, block_size, num_kv_heads, head_dim = cache_shape
    name = format_name(cache_format)
    if name is None or name in ELEM_TYPES:
        raise ValueError(f"store_quantized writes quantized formats, not {name}")
    if rows_dtype_name not in ELEM_TYPES:
        raise ValueError(f"store_quantized takes rows of {', '.join(ELEM_TYPES)}, not {rows_dtype_name}")
    _cache_code(rows_dtype_name, cache_format, block_size)  # the block size check
    code = lib.kvpage_store_quantized(CACHE_FORMATS[name], cache_ptr, num_blocks, block_size, num_kv_heads, head_dim,
                                      ELEM_TYPES[rows_dtype_name], rows_ptr, rows_strides[0], rows_strides[1],
                                      slots.ctypes.data, slots.shape[0])
    if code > 0:
        raise IndexError(f"KV slot {int(slots[code - 1])} outside the cache ({num_blocks * block_size} slots)")
    if code < 0:
        raise ValueError(f"the native {name} store refused head_dim {head_dim} (a multiple of {HEAD_DIM_MULTIPLE} "
                         f"up to {MAX_HEAD_DIM})")


def row_argmax(lib: ctypes.CDLL, rows_ptr: int, num_rows: int, num_cols: int, row_stride: int, max_ptr: int,
               index_ptr: int, num_threads: int) -> None:
    """Each float32 row's maximum (into ``max_ptr``, float32 ``[num_rows]``) and the index of
    its first maximal value (``index_ptr``, int64 ``[num_rows]``), as ``torch.max(dim=-1)``:
    a row holding NaN gets NaN and its first NaN's index. Rows are ``row_stride`` elements
    apart, ``num_cols`` contiguous values each; ``0 < num_cols < 2**31``."""
    if not 0 < num_cols < 2**31:
        raise ValueError(f"row_argmax takes 1 to 2**31 - 1 columns, not {num_cols}")
    lib.kvpage_row_argmax(rows_ptr, num_rows, num_cols, row_stride, max_ptr, index_ptr, num_threads)
