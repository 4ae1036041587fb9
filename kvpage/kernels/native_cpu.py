"""Native CPU kernels: paged attention, KV row stores, logits argmax.

Two variants of one C interface: ``native_cpu.cpp`` for CPUs with AVX-512F and
``native_cpu_avx2.cpp`` for CPUs with AVX2, FMA and F16C but no AVX-512 (both include
``native_cpu_common.h`` and ``native_cpu_api.h``). The one the CPU runs is built on first
use with the system C++ compiler (``g++ -O3 -march=native -fopenmp``, the toolchain
``torch.compile`` already needs on CPU) into ``$KVPAGE_CACHE/native/<hash>/``
(``~/.cache/kvpage``), keyed by the sources, the compiler and the CPU's flags, so later
processes load it in milliseconds; loaded with ctypes. Torch-free: arguments are raw
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
from pathlib import Path
from typing import Optional

import numpy as np

log = logging.getLogger("kvpage")

_HERE = Path(__file__).parent
#: The kernel source of each variant, best first, and the CPU flags it needs.
VARIANTS = {"avx512": (_HERE / "native_cpu.cpp", ("avx512f",)),
            "avx2": (_HERE / "native_cpu_avx2.cpp", ("avx2", "fma", "f16c"))}
_HEADERS = (_HERE / "native_cpu_common.h", _HERE / "native_cpu_api.h")
ABI_VERSION = 6
#: Element types the kernels take, by numpy/torch dtype name (the C ``elem_type`` codes).
ELEM_TYPES = {"float32": 0, "float16": 1, "bfloat16": 2}
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


@functools.lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None where they are unavailable (see the module docstring)."""
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
    lib.kvpage_decode_attention.argtypes = [_i32, _p, _i64, _i64, _p, _p, _i64, _i64, _i64, _i64, _p, _i64, _p, _i64,
                                            _f32, _i64, _f32, _p, _p, _i64, _i32]
    lib.kvpage_write_decode.restype = _i64
    lib.kvpage_write_decode.argtypes = [_i32, _p, _i64, _i64, _p, _i64, _i64, _p, _i64, _i64, _p, _i64, _p, _p, _i64,
                                        _i64, _i64, _i64, _i64, _p, _i64, _p, _i64, _f32, _i64, _f32, _p, _p, _i64,
                                        _i32]
    lib.kvpage_prefill_attention.restype = _i32
    lib.kvpage_prefill_attention.argtypes = [_i32, _p, _i64, _i64, _p, _p, _i64, _i64, _i64, _i64, _p, _i64, _p, _p,
                                             _i64, _i64, _f32, _i64, _f32, _p, _p, _i32]
    lib.kvpage_store_rows.restype = _i64
    lib.kvpage_store_rows.argtypes = [_p, _i64, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64]
    lib.kvpage_row_argmax.restype = None
    lib.kvpage_row_argmax.argtypes = [_p, _i64, _i64, _i64, _p, _p, _i32]
    lib.kvpage_prefill_uses_amx.restype = _i32
    lib.kvpage_prefill_uses_amx.argtypes = [_i32, _i64]
    return lib


def decode_supported(head_dim: int, num_heads: int, num_kv_heads: int, dtype_name: str) -> bool:
    """Whether :func:`decode_attention` takes these shapes and this element type."""
    return (dtype_name in ELEM_TYPES and head_dim % HEAD_DIM_MULTIPLE == 0 and 0 < head_dim <= MAX_HEAD_DIM
            and num_kv_heads > 0 and num_heads % num_kv_heads == 0)


def decode_attention(lib: ctypes.CDLL, dtype_name: str, q_ptr: int, q_strides: tuple, key_ptr: int, value_ptr: int,
                     cache_shape: tuple, num_heads: int, tables: np.ndarray, seq_lens: np.ndarray, num_seqs: int,
                     scale: float, window: int, softcap: float, sinks: Optional[np.ndarray], out_ptr: int,
                     num_splits: int, num_threads: int) -> None:
    """Decode attention of ``num_seqs`` query rows (one per sequence, its last context token).

    ``q`` (at ``q_ptr``, strides ``(token, head)`` in elements, head_dim contiguous), the
    caches (``cache_shape`` = ``[num_blocks, block_size, H_kv, D]``, contiguous) and the
    output (``[num_seqs, num_heads, D]``, contiguous) all hold ``dtype_name`` elements.
    ``tables`` int32 ``[>= num_seqs, max_blocks]`` C-contiguous rows, ``seq_lens`` int32;
    ``sinks`` float32 ``[num_heads]`` or None. The caller keeps every array alive and
    checks :func:`decode_supported` first.
    """
    _, block_size, num_kv_heads, head_dim = cache_shape
    code = lib.kvpage_decode_attention(
        ELEM_TYPES[dtype_name], q_ptr, q_strides[0], q_strides[1], key_ptr, value_ptr, block_size, num_kv_heads,
        head_dim, num_heads, tables.ctypes.data, tables.strides[0] // 4, seq_lens.ctypes.data, num_seqs, scale,
        window, softcap, None if sinks is None else sinks.ctypes.data, out_ptr, num_splits, num_threads)
    if code != 0:
        raise ValueError(f"native decode attention refused head_dim {head_dim} with {num_heads} query and "
                         f"{num_kv_heads} KV heads (code {code})")


def prefill_uses_amx(lib: ctypes.CDLL, dtype_name: str, head_dim: int) -> bool:
    """Whether :func:`prefill_attention` of this element type and head size runs its scores
    and P.V on the AMX tile unit (the AVX-512 variant, bf16, head size 64/128/256, a CPU with
    AMX-BF16, Linux's grant of tile state, ``KVPAGE_AMX`` not ``0``); otherwise on vectors."""
    return bool(lib.kvpage_prefill_uses_amx(ELEM_TYPES[dtype_name], head_dim))


def prefill_attention(lib: ctypes.CDLL, dtype_name: str, q_ptr: int, q_strides: tuple, key_ptr: int, value_ptr: int,
                      cache_shape: tuple, num_heads: int, tables: np.ndarray, query_start_loc: np.ndarray,
                      seq_lens: np.ndarray, first_seq: int, scale: float, window: int, softcap: float,
                      sinks: Optional[np.ndarray], out_ptr: int, num_threads: int) -> None:
    """Attention of the query rows of sequences ``first_seq:`` (each the last ``q_len``
    positions of its context; causal) into the same rows of the ``[T, num_heads, D]``
    contiguous output; earlier rows are left alone. Layouts as :func:`decode_attention`
    (any block size); ``query_start_loc`` int32 ``[B + 1]``. The caller checks
    :func:`decode_supported`, which covers this kernel too."""
    _, block_size, num_kv_heads, head_dim = cache_shape
    code = lib.kvpage_prefill_attention(
        ELEM_TYPES[dtype_name], q_ptr, q_strides[0], q_strides[1], key_ptr, value_ptr, block_size, num_kv_heads,
        head_dim, num_heads, tables.ctypes.data, tables.strides[0] // 4, query_start_loc.ctypes.data,
        seq_lens.ctypes.data, first_seq, seq_lens.shape[0], scale, window, softcap,
        None if sinks is None else sinks.ctypes.data, out_ptr, num_threads)
    if code != 0:
        raise ValueError(f"native prefill attention refused head_dim {head_dim} with {num_heads} query and "
                         f"{num_kv_heads} KV heads, or more queries than context (code {code})")


def write_decode(lib: ctypes.CDLL, dtype_name: str, q: tuple, k: Optional[tuple], v: Optional[tuple], slots_ptr: int,
                 num_new: int, key_ptr: int, value_ptr: int, cache_shape: tuple, num_heads: int, step: tuple,
                 scale: float, window: int, softcap: float, sinks_ptr: Optional[int], out_ptr: int,
                 num_threads: int) -> None:
    """Write ``num_new`` K/V rows to their slots, then :func:`decode_attention`, in one call.

    ``q``, ``k``, ``v`` are ``(address, token stride, head stride)`` in elements (head_dim
    contiguous); ``k`` None skips the write (a layer reading another layer's KV).
    ``slots_ptr`` addresses ``num_new`` int64 slots; ``step`` is ``(tables address, table
    row stride, seq_lens address, num_seqs, num_splits)``. Raises ``IndexError`` (nothing
    written or attended) for a slot outside the cache.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache_shape
    tables_ptr, table_stride, lens_ptr, num_seqs, num_splits = step
    k, v = k or (None, 0, 0), v or (None, 0, 0)
    code = lib.kvpage_write_decode(ELEM_TYPES[dtype_name], *q, *k, *v, slots_ptr, num_new, key_ptr, value_ptr,
                                   num_blocks, block_size, num_kv_heads, head_dim, num_heads, tables_ptr, table_stride,
                                   lens_ptr, num_seqs, scale, window, softcap, sinks_ptr, out_ptr, num_splits,
                                   num_threads)
    if code > 0:
        slot = ctypes.cast(slots_ptr, ctypes.POINTER(ctypes.c_int64))[code - 1]
        raise IndexError(f"KV slot {slot} outside the cache ({num_blocks * block_size} slots)")
    if code < 0:
        raise ValueError(f"native decode attention refused head_dim {head_dim} with {num_heads} query and "
                         f"{num_kv_heads} KV heads (code {code})")


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


def row_argmax(lib: ctypes.CDLL, rows_ptr: int, num_rows: int, num_cols: int, row_stride: int, max_ptr: int,
               index_ptr: int, num_threads: int) -> None:
    """Each float32 row's maximum (into ``max_ptr``, float32 ``[num_rows]``) and the index of
    its first maximal value (``index_ptr``, int64 ``[num_rows]``), as ``torch.max(dim=-1)``:
    a row holding NaN gets NaN and its first NaN's index. Rows are ``row_stride`` elements
    apart, ``num_cols`` contiguous values each; ``0 < num_cols < 2**31``."""
    if not 0 < num_cols < 2**31:
        raise ValueError(f"row_argmax takes 1 to 2**31 - 1 columns, not {num_cols}")
    lib.kvpage_row_argmax(rows_ptr, num_rows, num_cols, row_stride, max_ptr, index_ptr, num_threads)
