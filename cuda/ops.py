"""Python launch wrappers: ``store_kv`` and ``paged_attention`` on the GPU (or simulator).

Same contract as ``kvpage.attention.reference`` (see that module for the semantics).
Inputs may be CuPy arrays, torch CUDA tensors or Numba device arrays (zero-copy); host
numpy arrays are accepted for the metadata (copied on the launch stream) and, for
testing, for everything (results copied back, which synchronises). Launches go on the
caller's current stream and do not synchronise.

Dtypes: q and the caches are float16 or float32; torch bfloat16 runs on the fast decode
kernel only (it reads bits), so a bf16 batch must be decodes alone. Accumulation is fp32.

Quantized caches (``cache_format`` a quantized ``kvpage.core.kv_formats.CacheFormat``): uint8
buffers ``[num_blocks, block_bytes]`` (``quant_ops``); ``store_kv`` quantizes float16/float32
rows into them, byte-identical to ``kvpage.kernels.kv_quant.quantize_rows``, and
``paged_attention`` (float16/float32 q) decodes on the fast kernel for int8 and fp8 (float16 q,
``fast_dispatch``) and otherwise runs the reference kernels; all of them dequantize in
registers as they load (the fast kernel folds a row's scale into its score and weight).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np

from .fast_dispatch import dtype_name, launch_fast, num_sms, use_fast_decode
from .interop import CUPY, TORCH, array_kind, as_kernel_arg, empty_like_kind, resolve_stream, simulator_enabled
from .launch_args import LaunchArgs, meta_arg
from .launch_config import choose_decode_tiles, choose_splits, choose_tile, prefill_rows
from .quant_ops import check_rows, logical_shape, quantized, store_quantized
from .workspace import array_device, workspace

#: Dtypes of q and the caches (bfloat16: torch arrays, on the fast decode kernel only).
_FLOAT_DTYPES = ("float16", "float32", "bfloat16")
_DEFAULT_THREADS = 128
_SIM_THREADS = 16
#: One thread quantizes one (token, head) row: small blocks spread a step's rows over the SMs.
_QUANT_STORE_THREADS = 64


def _prepare() -> None:
    """Once per process before the first launch: a usable compiler setup (real GPU only)."""
    if not simulator_enabled():
        from .toolchain import ensure_toolchain

        ensure_toolchain()


def _check_float(name: str, x: Any) -> None:
    dt = dtype_name(x)
    if dt not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16 or float32 (or torch bfloat16 on the fast decode kernel), got {dt}")


def _host_int(x: Any, name: str) -> np.ndarray:
    """A host copy of a small metadata array (a device copy synchronises: pass numpy to avoid it)."""
    if isinstance(x, np.ndarray):
        return np.asarray(x, dtype=np.int64)
    kind = array_kind(x)
    if kind == TORCH:
        return x.detach().cpu().numpy().astype(np.int64)
    if kind == CUPY:
        return x.get().astype(np.int64)
    return x.copy_to_host().astype(np.int64)


def _result(out: Any, like: Any) -> Any:
    """Return host numpy for host numpy input (outside the simulator), else the device array."""
    if isinstance(like, np.ndarray) and not isinstance(out, np.ndarray):
        return out.copy_to_host()
    return out


def store_kv(key_cache: Any, value_cache: Any, k: Any, v: Any, slot_mapping: Any, cache_format: Any = None, *,
             stream: Optional[Any] = None, threads_per_block: Optional[int] = None) -> None:
    """Scatter ``k``/``v`` ``[T, H_kv, D]`` into the caches at flat slots ``slot_mapping [T]``.

    The caches are updated in place, so they must be device arrays (host numpy only under
    the simulator). Negative slots are skipped (padding tokens). With a quantized
    ``cache_format`` the caches are its uint8 buffers and each row is quantized as it is
    stored (``quant_ops.store_quantized``).
    """
    fmt = quantized(cache_format)
    if fmt is not None:
        _prepare()
        threads = threads_per_block or (_SIM_THREADS if simulator_enabled() else _QUANT_STORE_THREADS)
        store_quantized(key_cache, value_cache, k, v, slot_mapping, fmt,
                        resolve_stream(stream, (key_cache, k)), threads)
        return
    if tuple(key_cache.shape) != tuple(value_cache.shape) or len(key_cache.shape) != 4:
        raise ValueError(f"key/value caches must share a 4-D shape, got {tuple(key_cache.shape)} "
                         f"and {tuple(value_cache.shape)}")
    if tuple(k.shape) != tuple(v.shape) or len(k.shape) != 3 or tuple(k.shape[1:]) != tuple(key_cache.shape[2:]):
        raise ValueError(f"k/v must be [T, {key_cache.shape[2]}, {key_cache.shape[3]}], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if tuple(slot_mapping.shape) != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if isinstance(slot_mapping, np.ndarray):
        capacity = key_cache.shape[0] * key_cache.shape[1]
        if slot_mapping.size and int(np.max(slot_mapping)) >= capacity:
            raise ValueError(f"slot_mapping has a slot >= num_blocks * block_size ({capacity})")
    for name, arr in (("key_cache", key_cache), ("value_cache", value_cache)):
        if isinstance(arr, np.ndarray) and not simulator_enabled():
            raise ValueError(f"{name} must be a device array: store_kv writes it in place")
    total = int(np.prod(k.shape))
    if total == 0:
        return
    from .store_kernels import store_kernel  # numba.cuda loads here, after validation

    _prepare()
    threads = threads_per_block or (_SIM_THREADS if simulator_enabled() else 256)
    launch_stream = resolve_stream(stream, (key_cache, k))
    args = [as_kernel_arg(a, launch_stream) for a in (key_cache, value_cache, k, v)]
    slots = meta_arg(slot_mapping, np.int64, launch_stream)
    blocks = min(-(-total // threads), 1 << 20)
    store_kernel()[blocks, threads, launch_stream](*args, slots)


def paged_attention(
    q: Any, key_cache: Any, value_cache: Any, query_start_loc: Any, seq_lens: Any, block_tables: Any,
    scaling: float, sliding_window: Optional[int] = None, softcap: Optional[float] = None,
    sinks: Optional[Any] = None, *, num_splits: Optional[int] = None, stream: Optional[Any] = None,
    num_decodes: Optional[int] = None, max_prefill_query_len: Optional[int] = None,
    max_seq_len: Optional[int] = None, threads_per_block: Optional[int] = None, kv_tile: Optional[int] = None,
    decode_kernel: str = "auto", cache_format: Any = None,
) -> Any:
    """Paged attention over a ragged batch; returns ``[T, H, D]`` in ``q``'s dtype.

    The first ``num_decodes`` sequences (query length 1) go to a split-K decode kernel, the
    rest to the prefill path (causal w.r.t. absolute positions). With device metadata pass
    ``num_decodes``/``max_prefill_query_len`` (the longest query after the decodes)/
    ``max_seq_len`` (``StepMetadata`` has each), or they are read back (one synchronising copy).

    Args beyond the reference contract:
        decode_kernel: ``"auto"`` (the fast kernel where it serves the call on a real GPU),
            ``"fast"`` (required: else a ValueError says why) or ``"reference"`` (``fast_dispatch``).
        num_splits: decode split-K factor (None: chosen from the SM count; 1: no merge). The
            reference kernel keeps at most ``launch_config.MAX_DECODE_PARTITION`` keys per
            block, so a longer context gets the splits it needs beyond this number.
        stream: stream to launch on (default: the arrays' library's current stream).
        threads_per_block, kv_tile: reference-kernel knobs (defaults: 128 threads, the largest
            tile in 46 KiB of shared memory; tiny values keep the simulator fast).
        cache_format: a quantized ``CacheFormat`` for uint8 caches ``[num_blocks, block_bytes]``
            (int8 and fp8 decodes of float16 q take the fast kernel under ``"auto"`` on a real GPU;
            int4 decodes on the reference kernel, so ``"fast"`` is a ValueError there); None or
            an unquantized one: caches of values.
    """
    fmt = quantized(cache_format)
    shapes = _check_attention_shapes(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, sinks, fmt)
    window = int(sliding_window or 0)
    if window < 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    num_seqs = int(seq_lens.shape[0])
    sizes = _batch_sizes(query_start_loc, seq_lens, shapes.num_tokens, window, num_decodes, max_prefill_query_len,
                         max_seq_len)
    has_prefill = num_seqs > sizes.num_decodes and sizes.max_prefill_query_len > 0
    fast = use_fast_decode(decode_kernel, q, key_cache, value_cache, shapes.head_dim, shapes.group, has_prefill, fmt)
    kv_format = fmt.kv_format.name if fmt is not None else None
    _prepare()
    launch_stream = resolve_stream(stream, (q, key_cache))
    out = _new_output(q, (shapes.num_tokens, shapes.num_heads, shapes.head_dim), launch_stream)
    if shapes.num_tokens == 0 or num_seqs == 0:
        return _result(out, q)
    threads = threads_per_block or (_SIM_THREADS if simulator_enabled() else _DEFAULT_THREADS)
    launch = LaunchArgs.build((q, key_cache, value_cache, out), (query_start_loc, seq_lens, block_tables), sinks,
                              float(scaling), window, float(softcap or 0.0), launch_stream, threads,
                              workspace(array_device(q, array_kind(q)), launch_stream))
    if sizes.num_decodes and fast:
        launch_fast(launch, sizes.num_decodes, num_seqs, sizes.max_decode_ctx, num_splits, fmt)
    elif sizes.num_decodes:
        _launch_decode(launch, shapes, sizes, num_splits, kv_tile, kv_format)
    if has_prefill:
        _launch_prefill(launch, shapes, sizes, num_seqs, kv_tile, kv_format)
    return _result(out, q)


def _new_output(q: Any, shape: tuple, stream: Any) -> Any:
    """An uninitialised output in ``q``'s library and dtype (torch bfloat16 included)."""
    if array_kind(q) == TORCH:
        return sys.modules["torch"].empty(shape, dtype=q.dtype, device=q.device)
    return empty_like_kind(q, shape, q.dtype, stream)


@dataclass(frozen=True, slots=True)
class _Shapes:
    """One call's sizes: q ``[num_tokens, num_heads, head_dim]``, caches of ``num_kv_heads`` heads."""

    num_tokens: int
    num_heads: int
    head_dim: int
    num_kv_heads: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True, slots=True)
class _BatchSizes:
    """What the launches are sized by."""

    num_decodes: int  # leading sequences with one query token (the decode path)
    max_decode_ctx: int  # tokens: the longest context a decode attends (sliding window included)
    max_prefill_query_len: int  # tokens: the longest query after the decodes
    max_seq_len: int  # tokens: the longest context


def _batch_sizes(query_start_loc, seq_lens, num_tokens: int, window: int, num_decodes: Optional[int],
                 max_prefill_query_len: Optional[int], max_seq_len: Optional[int]) -> _BatchSizes:
    """The caller's sizes when it gave all three, else read from the (host) metadata."""
    if num_decodes is None or max_prefill_query_len is None or max_seq_len is None:
        sizes = _sizes_from_host(query_start_loc, seq_lens, num_tokens, num_decodes)
    else:
        sizes = _BatchSizes(num_decodes, max_seq_len, max_prefill_query_len, max_seq_len)
    if window:
        sizes = replace(sizes, max_decode_ctx=min(sizes.max_decode_ctx, window))
    return sizes


def _launch_decode(launch: LaunchArgs, shapes: _Shapes, sizes: _BatchSizes, num_splits: Optional[int],
                   kv_tile: Optional[int], kv_format: Optional[str]) -> None:
    """The split-K decode of the first ``sizes.num_decodes`` sequences."""
    from .attention_kernels import merge_kernel  # numba.cuda loads here, not before
    from .decode_kernels import decode_kernel

    tile, max_partition = choose_decode_tiles(shapes.group, shapes.head_dim, launch.threads, kv_tile)
    splits, partition = choose_splits(sizes.num_decodes * shapes.num_kv_heads, sizes.max_decode_ctx, tile, num_sms(),
                                      num_splits, max_partition)
    launch.decode(decode_kernel(shapes.head_dim, shapes.group, tile, max_partition, launch.threads, kv_format),
                  merge_kernel,
                  sizes.num_decodes, shapes.num_kv_heads, shapes.num_heads, shapes.head_dim, splits, partition)


def _launch_prefill(launch: LaunchArgs, shapes: _Shapes, sizes: _BatchSizes, num_seqs: int,
                    kv_tile: Optional[int], kv_format: Optional[str]) -> None:
    """The tiled attention of the sequences after the decodes (prefills and chunks)."""
    from .attention_kernels import attention_kernel  # numba.cuda loads here, not before

    rows = prefill_rows(shapes.group, 4 if simulator_enabled() else 16)
    tile = kv_tile or choose_tile(rows, shapes.head_dim)
    row_tiles = -(-(sizes.max_prefill_query_len * shapes.group) // rows)
    launch.prefill(attention_kernel(rows, shapes.head_dim, shapes.group, tile, launch.threads, kv_format),
                   (num_seqs - sizes.num_decodes) * row_tiles, shapes.num_kv_heads, sizes.num_decodes, row_tiles,
                   max(1, sizes.max_seq_len))


def _check_attention_shapes(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, sinks,
                            fmt=None) -> _Shapes:
    """Validate shapes and dtypes; return the call's sizes (``fmt``: a quantized CacheFormat)."""
    if fmt is not None and len(q.shape) == 3:
        check_rows("q", q)
        _, _, num_kv_heads, head_dim = logical_shape(key_cache, value_cache, int(q.shape[2]), fmt)
        _check_batch_shapes(int(q.shape[1]), num_kv_heads, query_start_loc, seq_lens, block_tables, sinks)
        return _Shapes(int(q.shape[0]), int(q.shape[1]), head_dim, num_kv_heads)
    if len(q.shape) != 3 or len(key_cache.shape) != 4 or tuple(key_cache.shape) != tuple(value_cache.shape):
        raise ValueError(f"expected q [T, H, D] and two equal caches [N, B, H_kv, D], got {tuple(q.shape)}, "
                         f"{tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    num_tokens, num_heads, head_dim = (int(s) for s in q.shape)
    num_kv_heads = int(key_cache.shape[2])
    if int(key_cache.shape[3]) != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, caches have {key_cache.shape[3]}")
    for name, arr in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        _check_float(name, arr)
    _check_batch_shapes(num_heads, num_kv_heads, query_start_loc, seq_lens, block_tables, sinks)
    return _Shapes(num_tokens, num_heads, head_dim, num_kv_heads)


def _check_batch_shapes(num_heads: int, num_kv_heads: int, query_start_loc, seq_lens, block_tables, sinks) -> None:
    """The GQA ratio and the metadata's shapes."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    num_seqs = int(seq_lens.shape[0])
    if tuple(query_start_loc.shape) != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    if len(block_tables.shape) != 2 or int(block_tables.shape[0]) != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must be [{num_heads}], got {tuple(sinks.shape)}")


def _sizes_from_host(query_start_loc, seq_lens, num_tokens: int, num_decodes: Optional[int]) -> _BatchSizes:
    """The batch's sizes, read on the host (``num_decodes`` None: the leading one-token queries)."""
    qsl = _host_int(query_start_loc, "query_start_loc")
    lens = _host_int(seq_lens, "seq_lens")
    num_seqs = int(lens.shape[0])
    q_lens = np.diff(qsl)
    if num_seqs and (qsl[0] != 0 or qsl[-1] != num_tokens or (q_lens < 0).any()):
        raise ValueError("query_start_loc must rise from 0 to num_tokens")
    if (lens < q_lens).any():
        raise ValueError("seq_lens must be >= each sequence's query length")
    if num_decodes is None:
        from kvpage.core.sched.metadata import leading_decodes

        num_decodes = leading_decodes(q_lens)
    max_decode_ctx = int(lens[:num_decodes].max()) if num_decodes else 0
    max_prefill_query_len = int(q_lens[num_decodes:].max()) if num_seqs > num_decodes else 0
    max_seq_len = int(lens.max()) if num_seqs else 0
    return _BatchSizes(num_decodes, max_decode_ctx, max_prefill_query_len, max_seq_len)
