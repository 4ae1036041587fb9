"""CPU paged-attention dispatcher: one entry point, the fastest measured backend per phase.

Import is torch- and numba-free; backends load on first use.

Per step, build a :class:`CPUAttentionMetadata` once (``prepare_cpu_attention_metadata``)
and pass it as ``metadata=`` to every layer's :func:`paged_attention_cpu` /
:func:`write_kv_cpu` call: index arrays are converted (int32 for numba, int64 tensors for
torch), the decode/prefill split is found and the numba work tiles are built once, not
per layer.

Choice, measured on the 2-core AMD EPYC build VM (AVX-512; torch and numba both at 2
threads; fp32, block_size 16, 8 query / 4 KV heads, head_dim 64). The VM is shared, so
absolute times swing 2-4x between runs; ratios come from interleaved calls
(``benchmarks/bench_attention_cpu.py``, ``test_bench_decode_target_ratio``):

* decode, batch 32 x context 512: numba paged kernel / contiguous SDPA (the no-paging
  bound) = 1.30-1.39 over three runs (e.g. 3.44 ms vs 2.48 ms); torch gather + SDPA 6-8x
  (the gather copies the whole context first). -> decode uses numba.
* prefill, one 512-token prompt: torch ~4.8 ms vs numba ~44 ms (contiguous SDPA 3.6 ms);
  a 128-token chunk over 1024 context: torch ~3.8 ms vs numba ~30 ms. SDPA's blocked
  kernel beats the scalar-softmax numba tiles ~8-10x once there are many query rows.
  -> prefill uses torch (the numba tile kernel stays as the torch-free path for numpy
  inputs, and for softcap/sinks it avoids the fp32 math fallback).

K and V of different shapes (MLA models such as DeepSeek-V2/V3 and MiniCPM3, whose V head
is smaller than K's) always take the torch backend, both phases: the numba kernels read K
and V of one shape (``kv_layouts_differ``).

Those figures chose between numba and torch. Since then torch inputs take the native
kernels (:mod:`kvpage.kernels.native_cpu`) where they build:

* prefill: ten ~210-token prompts, SmolLM2's heads (9 query / 3 KV, head_dim 64): the
  matmul-shaped native kernel takes 3.9 ms per layer in bf16 and 7.4 ms in fp32, against
  11.9 and 13.1 ms for gather + SDPA (interleaved calls; the dot-product kernel before it
  took 6.9 and 9.8 ms).
* decode: numba and torch each keep an OpenMP thread pool (two copies of GNU OpenMP);
  when calls alternate, the idle pool's spinning worker competes with the busy one. The
  native kernel runs on torch's pool, and decode-only steps write K/V and attend in one
  native call per layer (:func:`write_and_attend_cpu`). A bf16 decode step of
  SmolLM2-135M at batch 16 (contexts 100-180, compiled model) took 34.9 ms that way
  against 43.9 ms on the numba kernels, run back to back: attention and writes 4.8 ms
  instead of 9.0 ms, and the linears faster too with no second pool spinning. At batch
  34 x context 220 (offline) the kernel is bound by reading scattered KV blocks from
  DRAM; prefetching them into L2 instead of L1 made that 1.4x faster.

Numba (decode) and torch (prefill) stay the paths wherever the native library is
unavailable, and numba serves numpy inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

#: Backend for non-decode sequences of torch inputs: "native" (the C++ kernel; torch
#: where it is unavailable or unfit), "numba" or "torch"; see the module docstring.
PREFILL_BACKEND = "native"
#: Backend for the leading query-length-1 sequences of torch inputs: "native" (the C++
#: kernel of :mod:`kvpage.kernels.native_cpu`; numba where it is unavailable or unfit),
#: "numba" or "torch".
DECODE_BACKEND = "native"
#: The numba decode kernel is specialized per head size through tuple-length types, and
#: numba's parallel loops cannot carry tuples much longer than this: larger heads (Gemma4's
#: 512-wide global layers) decode on torch.
NUMBA_DECODE_MAX_HEAD_DIM = 256


def decodes_of(query_start_loc, num_decodes: Optional[int]) -> int:
    """``num_decodes`` as given (a ``StepMetadata`` carries it), else the leading run of
    query-length-1 sequences by the metadata's own rule."""
    if num_decodes is not None:
        return int(num_decodes)
    from kvpage.core.sched.metadata import leading_decodes

    return leading_decodes(np.diff(np.asarray(query_start_loc, dtype=np.int64)))


def _to_numpy(a, dtype) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor; no torch import needed to convert it
        a = a.detach().cpu().numpy()
    return np.ascontiguousarray(a, dtype=dtype)


@dataclass
class CPUAttentionMetadata:
    """Index arrays of one step, converted once for all layers.

    Attributes:
        query_start_loc: int32 [B + 1].
        seq_lens: int32 [B] context length per sequence (tokens).
        block_tables: int32 [B, max_blocks], C-contiguous.
        num_decodes: leading sequences with query length 1.
        slot_mapping: int64 [T] flat KV slots for ``write_kv_cpu``, or None.
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    num_decodes: int
    slot_mapping: Optional[np.ndarray] = None
    _work: Optional[np.ndarray] = None
    _torch: dict = field(default_factory=dict)
    _splits: dict = field(default_factory=dict)

    @property
    def work(self) -> np.ndarray:
        """Numba prefill work tiles (built on first use)."""
        if self._work is None:
            from kvpage.attention.numba_cpu import build_work_tiles

            self._work = build_work_tiles(self.query_start_loc, self.num_decodes)
        return self._work

    def decode_splits(self, num_threads: int, block_size: int) -> int:
        """Context splits per decode sequence (``numba_decode.decode_splits``), once per step."""
        key = (num_threads, block_size)
        if key not in self._splits:
            from kvpage.kernels.numba_decode import decode_splits

            longest = int(self.seq_lens[:self.num_decodes].max()) if self.num_decodes else 0
            self._splits[key] = decode_splits(self.num_decodes, longest, block_size, num_threads)
        return self._splits[key]

    def native_step(self, num_threads: int, block_size: int) -> tuple:
        """The step's arguments of :func:`native_cpu.write_decode` (addresses stay valid
        while this metadata lives)."""
        return (self.block_tables.ctypes.data, self.block_tables.strides[0] // 4, self.seq_lens.ctypes.data,
                self.num_decodes, self.decode_splits(num_threads, block_size))

    def torch_index(self, name: str) -> Any:
        """``name``'s array as an int64 CPU tensor, converted on first use."""
        if name not in self._torch:
            import torch

            self._torch[name] = torch.from_numpy(getattr(self, name).astype(np.int64))
        return self._torch[name]


def prepare_cpu_attention_metadata(query_start_loc, seq_lens, block_tables, slot_mapping=None,
                                   num_decodes: Optional[int] = None) -> CPUAttentionMetadata:
    """Build the per-step metadata from numpy or torch index arrays (see module docstring).

    ``num_decodes`` comes from ``StepMetadata.num_decodes``; standalone callers may omit it.
    """
    qsl = _to_numpy(query_start_loc, np.int32)
    lens = _to_numpy(seq_lens, np.int32)
    tables = _to_numpy(block_tables, np.int32)
    if qsl.ndim != 1 or lens.shape != (qsl.shape[0] - 1,) or tables.ndim != 2 or tables.shape[0] != lens.shape[0]:
        raise ValueError(f"inconsistent metadata shapes: query_start_loc {qsl.shape}, seq_lens {lens.shape}, "
                         f"block_tables {tables.shape}")
    if np.any(np.diff(qsl) > lens):
        raise ValueError("a sequence has more queries than context tokens (query_start_loc vs seq_lens)")
    slots = None if slot_mapping is None else _to_numpy(slot_mapping, np.int64)
    return CPUAttentionMetadata(qsl, lens, tables, decodes_of(qsl, num_decodes), slots)


def kv_layouts_differ(key_cache, value_cache) -> bool:
    """True when K and V rows differ in heads or head size (then only torch serves them)."""
    return tuple(key_cache.shape[2:]) != tuple(value_cache.shape[2:])


def _numba_available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def paged_attention_cpu(
    q,
    key_cache,
    value_cache,
    query_start_loc=None,
    seq_lens=None,
    block_tables=None,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks=None,
    *,
    metadata: Optional[CPUAttentionMetadata] = None,
    decode_backend: Optional[str] = None,
    prefill_backend: Optional[str] = None,
    attention_chunk: Optional[int] = None,
    alibi_slopes=None,
):
    """The contract's ``paged_attention`` on CPU; torch tensors or numpy arrays in, same kind out.

    Pass either the three index arrays (numpy or torch) or ``metadata=`` (preferred: built
    once per step). ``q`` is ``[T, H, D]``; caches ``[num_blocks, block_size, H_kv, D]``
    of the same dtype (float32/float16/bfloat16); V's heads and head size may differ from
    K's (then the output is ``[T, H, D_v]``). Output has ``q``'s dtype.
    Backends: ``"numba"`` or ``"torch"`` per phase (defaults ``DECODE_BACKEND`` /
    ``PREFILL_BACKEND``); numpy inputs use numba (the reference if numba is missing).
    K and V of different shapes always take torch (the reference for numpy inputs), and
    so do chunked attention (``attention_chunk``, Llama 4) and ALiBi (``alibi_slopes``,
    Bloom, MPT), which only those two implement.
    """
    if scaling is None:
        raise ValueError("scaling is required")
    if metadata is None:
        if query_start_loc is None or seq_lens is None or block_tables is None:
            raise ValueError("pass query_start_loc, seq_lens and block_tables, or metadata=")
        metadata = prepare_cpu_attention_metadata(query_start_loc, seq_lens, block_tables)
    if attention_chunk or alibi_slopes is not None:
        if not _is_torch(q):
            from kvpage.attention.reference import paged_attention_reference

            return paged_attention_reference(q, key_cache, value_cache, metadata.query_start_loc, metadata.seq_lens,
                                             metadata.block_tables, scaling, sliding_window, softcap, sinks,
                                             attention_chunk=attention_chunk, alibi_slopes=alibi_slopes)
        import torch

        from kvpage.attention.torch_cpu import paged_attention_torch

        return paged_attention_torch(q, key_cache, value_cache, metadata.torch_index("query_start_loc"),
                                     metadata.torch_index("seq_lens"), metadata.torch_index("block_tables"), scaling,
                                     sliding_window, softcap, sinks, num_decodes=metadata.num_decodes,
                                     attention_chunk=attention_chunk,
                                     alibi_slopes=None if alibi_slopes is None else torch.as_tensor(
                                         alibi_slopes, dtype=torch.float32))
    decode_backend = decode_backend or DECODE_BACKEND
    prefill_backend = prefill_backend or PREFILL_BACKEND
    if not _numba_available() or kv_layouts_differ(key_cache, value_cache):
        decode_backend = prefill_backend = "torch"
    if q.shape[-1] > NUMBA_DECODE_MAX_HEAD_DIM:
        decode_backend = "torch"
    if not _is_torch(q):
        if decode_backend == "torch":  # numba missing or unfit: the numpy oracle is the only numpy path
            from kvpage.attention.reference import paged_attention_reference

            return paged_attention_reference(q, key_cache, value_cache, metadata.query_start_loc,
                                             metadata.seq_lens, metadata.block_tables, scaling, sliding_window,
                                             softcap, sinks)
        return _numba_numpy(q, key_cache, value_cache, metadata, scaling, sliding_window, softcap, sinks)
    return _dispatch_torch(q, key_cache, value_cache, metadata, scaling, sliding_window, softcap, sinks,
                           decode_backend, prefill_backend)


def write_and_attend_cpu(q, k, v, key_cache, value_cache, scaling: float, sliding_window: Optional[int] = None,
                         softcap: Optional[float] = None, sinks=None, *, metadata: CPUAttentionMetadata,
                         write: bool = True):
    """:func:`write_kv_cpu` of ``k``/``v`` (unless ``write`` is False), then
    :func:`paged_attention_cpu` of ``q``; same contracts and result.

    A decode-only step of torch tensors that the native kernel takes (one dtype throughout,
    K and V of one layout) runs both in one native call: per layer this is the hot path of a
    decode step, and the separate calls cost several times the kernel's own work in Python.
    """
    if _fused_native_fits(q, k, v, key_cache, value_cache, metadata, write):
        from kvpage.kernels import native_cpu

        num_threads = _torch_threads()
        sinks_np = _sinks_f32(sinks)
        result = q.new_empty(q.shape)
        qs = q.stride()
        rows = (None, None, None)
        if write:
            ks, vs = k.stride(), v.stride()
            rows = ((k.data_ptr(), ks[0], ks[1]), (v.data_ptr(), vs[0], vs[1]), metadata.slot_mapping.ctypes.data)
        native_cpu.write_decode(
            native_cpu.library(), _dtype_name(q.dtype), (q.data_ptr(), qs[0], qs[1]), *rows, q.shape[0],
            key_cache.data_ptr(), value_cache.data_ptr(),
            tuple(key_cache.shape), q.shape[1], metadata.native_step(num_threads, key_cache.shape[1]), scaling,
            int(sliding_window or 0), float(softcap or 0.0), None if sinks_np is None else sinks_np.ctypes.data,
            result.data_ptr(), num_threads)
        return result
    if write:
        write_kv_cpu(key_cache, value_cache, k, v, metadata=metadata)
    return paged_attention_cpu(q, key_cache, value_cache, scaling=scaling, sliding_window=sliding_window,
                               softcap=softcap, sinks=sinks, metadata=metadata)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _sinks_f32(sinks) -> Optional[np.ndarray]:
    """Per-head sinks (torch of any float dtype, or numpy) as contiguous float32, or None."""
    if sinks is None:
        return None
    return _to_numpy(sinks.float() if _is_torch(sinks) else sinks, np.float32)


def _fused_native_fits(q, k, v, key_cache, value_cache, md: CPUAttentionMetadata, write: bool) -> bool:
    if DECODE_BACKEND != "native" or not _is_torch(q) or md.num_decodes != md.seq_lens.shape[0]:
        return False
    if q.shape[0] != md.num_decodes or (write and (md.slot_mapping is None or md.slot_mapping.shape[0] != q.shape[0])):
        return False
    dtype = q.dtype
    if key_cache.dtype != dtype or value_cache.dtype != dtype or key_cache.shape != value_cache.shape:
        return False
    if write and (k.dtype != dtype or v.dtype != dtype or k.shape[1:] != key_cache.shape[2:]
                  or v.shape[1:] != key_cache.shape[2:] or k.stride(-1) != 1 or v.stride(-1) != 1):
        return False
    return (q.stride(-1) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
            and _native_decodable(q, key_cache))


def _numba_numpy(q, key_cache, value_cache, md, scaling, sliding_window, softcap, sinks):
    from kvpage.attention.numba_cpu import paged_attention_numba

    out = paged_attention_numba(q, key_cache, value_cache, md.query_start_loc, md.seq_lens, md.block_tables,
                                scaling, sliding_window, softcap, sinks, num_decodes=md.num_decodes, work=md.work)
    return out.astype(q.dtype, copy=False)


def _dispatch_torch(q, key_cache, value_cache, md, scaling, sliding_window, softcap, sinks, decode_backend,
                    prefill_backend):
    import torch

    from kvpage.attention import torch_cpu

    nd, num_seqs = md.num_decodes, md.seq_lens.shape[0]
    if "native" in (decode_backend, prefill_backend) and (not nd or decode_backend == "native") \
            and prefill_backend != "numba" and _native_decodable(q, key_cache):
        return _native_attention(q, key_cache, value_cache, md, scaling, sliding_window, softcap, sinks,
                                 prefill_backend == "native")
    decode_backend = "numba" if decode_backend == "native" else decode_backend
    prefill_backend = "torch" if prefill_backend == "native" else prefill_backend
    use_numba = (nd and decode_backend == "numba") or (nd < num_seqs and prefill_backend == "numba")
    if not use_numba:
        return torch_cpu.paged_attention_torch(q, key_cache, value_cache, md.torch_index("query_start_loc"),
                                               md.torch_index("seq_lens"), md.torch_index("block_tables"), scaling,
                                               sliding_window, softcap, sinks, num_decodes=nd)
    from kvpage.attention.numba_cpu import paged_attention_numba

    kc, vc, cache_dtype = _cache_views(key_cache, value_cache)
    sinks_np = _sinks_f32(sinks)
    out = np.zeros(tuple(q.shape), dtype=np.float32)
    numba_decodes = nd if decode_backend == "numba" else 0
    work = md.work if prefill_backend == "numba" else md.work[:0]
    paged_attention_numba(q.detach().float().numpy(), kc, vc, md.query_start_loc, md.seq_lens, md.block_tables,
                          scaling, sliding_window, softcap, sinks_np, cache_dtype=cache_dtype,
                          num_decodes=numba_decodes, work=work, out=out)
    result = torch.from_numpy(out).to(q.dtype)
    if numba_decodes != nd:
        result[:nd] = torch_cpu.decode_torch(q[:nd], key_cache, value_cache, md.torch_index("seq_lens")[:nd],
                                             md.torch_index("block_tables")[:nd], scaling, sliding_window, softcap,
                                             None if sinks is None else torch.as_tensor(sinks, dtype=torch.float32))
    if prefill_backend != "numba" and nd < num_seqs:
        _torch_prefill_into(result, q, key_cache, value_cache, md, scaling, sliding_window, softcap, sinks)
    return result


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


def _native_decodable(q, key_cache) -> bool:
    """Whether the native decode kernel takes these tensors (caches already match in layout)."""
    from kvpage.kernels import native_cpu

    name = _dtype_name(key_cache.dtype)
    return (q.dtype == key_cache.dtype and key_cache.device.type == "cpu" and native_cpu.library() is not None
            and native_cpu.decode_supported(q.shape[2], q.shape[1], key_cache.shape[2], name))


def _native_attention(q, key_cache, value_cache, md, scaling, sliding_window, softcap, sinks, prefill_native: bool):
    """Decode rows through the native kernel, straight into the output; prefill rows through
    the native prefill kernel (``prefill_native``) or torch."""
    import torch

    from kvpage.kernels import native_cpu

    if q.stride(-1) != 1:
        q = q.contiguous()
    if not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("the native attention kernels need contiguous CPU caches")
    result = torch.empty(q.shape, dtype=q.dtype)
    lib, name, num_threads = native_cpu.library(), _dtype_name(q.dtype), _torch_threads()
    sinks_np = _sinks_f32(sinks)
    window, cap = int(sliding_window or 0), float(softcap or 0.0)
    if md.num_decodes:
        native_cpu.decode_attention(lib, name, q.data_ptr(), q.stride()[:2], key_cache.data_ptr(),
                                    value_cache.data_ptr(), tuple(key_cache.shape), q.shape[1], md.block_tables,
                                    md.seq_lens, md.num_decodes, scaling, window, cap, sinks_np, result.data_ptr(),
                                    md.decode_splits(num_threads, key_cache.shape[1]), num_threads)
    if md.num_decodes < md.seq_lens.shape[0]:
        if prefill_native:
            native_cpu.prefill_attention(lib, name, q.data_ptr(), q.stride()[:2], key_cache.data_ptr(),
                                         value_cache.data_ptr(), tuple(key_cache.shape), q.shape[1], md.block_tables,
                                         md.query_start_loc, md.seq_lens, md.num_decodes, scaling, window, cap,
                                         sinks_np, result.data_ptr(), num_threads)
        else:
            _torch_prefill_into(result, q, key_cache, value_cache, md, scaling, sliding_window, softcap, sinks)
    return result


def _torch_prefill_into(result, q, key_cache, value_cache, md, scaling, sliding_window, softcap, sinks) -> None:
    import torch

    from kvpage.attention.torch_cpu import prefill_one_torch

    sinks_t = None if sinks is None else torch.as_tensor(sinks, dtype=torch.float32)
    tables = md.torch_index("block_tables")
    bounds = md.query_start_loc.tolist()
    for i, seq_len in enumerate(md.seq_lens.tolist()[md.num_decodes:], start=md.num_decodes):
        start, end = bounds[i], bounds[i + 1]
        if end > start:
            result[start:end] = prefill_one_torch(q[start:end], key_cache, value_cache, seq_len, tables[i], scaling,
                                                  sliding_window, softcap, sinks_t)


def _cache_views(key_cache, value_cache):
    """Zero-copy numpy views of torch caches for numba: fp32 as is, fp16/bf16 as uint16 bits."""
    if key_cache.device.type != "cpu" or not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("numba backend needs contiguous CPU caches")
    name = _dtype_name(key_cache.dtype)
    if name is None:
        raise ValueError(f"unsupported cache dtype {key_cache.dtype}")
    return _numba_view(key_cache), _numba_view(value_cache), name


#: Torch dtypes the native and numba kernels read, by the name they take (``cache_dtype``).
_KERNEL_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}


def _dtype_name(dtype) -> Optional[str]:
    """``dtype``'s name in :data:`_KERNEL_DTYPES`, or None for a dtype no kernel reads."""
    return _KERNEL_DTYPES.get(str(dtype))


def _numba_view(t):
    """A contiguous CPU tensor as numba sees it: fp32 as is, 16-bit floats as uint16 bits."""
    import torch

    return (t if t.dtype == torch.float32 else t.view(torch.uint16)).numpy()


def write_kv_cpu(key_cache, value_cache, k, v, slot_mapping=None, *,
                 metadata: Optional[CPUAttentionMetadata] = None) -> None:
    """The contract's ``write_kv`` on CPU (torch tensors or numpy arrays), in place.

    Slots come from ``slot_mapping`` or ``metadata.slot_mapping``. Contiguous torch caches
    take the native row store, else numba's when numba is there, else ``index_copy_``.
    """
    if slot_mapping is None:
        if metadata is None or metadata.slot_mapping is None:
            raise ValueError("pass slot_mapping, or metadata built with slot_mapping")
        slot_mapping = metadata.slot_mapping
    if _is_torch(key_cache):
        if _row_storable(key_cache, value_cache):
            slots = _to_numpy(slot_mapping, np.int64)
            if slots.shape[0] != k.shape[0] or slots.shape[0] != v.shape[0]:
                raise ValueError(f"slot_mapping has {slots.shape[0]} slots for {k.shape[0]} K and {v.shape[0]} V rows")
            if _store_native(key_cache, value_cache, k, v, slots):
                return
            if _numba_available():
                _store_numba(key_cache, value_cache, k, v, slots)
                return
        from kvpage.attention.torch_cpu import write_kv_torch

        write_kv_torch(key_cache, value_cache, k, v, slot_mapping)
    else:
        from kvpage.attention.reference import write_kv_reference

        write_kv_reference(key_cache, value_cache, k, v, slot_mapping)


def _row_storable(key_cache, value_cache) -> bool:
    """Contiguous CPU caches of one dtype the row stores (native, numba) write."""
    return (key_cache.device.type == "cpu" and key_cache.dtype == value_cache.dtype
            and _dtype_name(key_cache.dtype) is not None and key_cache.is_contiguous() and value_cache.is_contiguous())


def _store_native(key_cache, value_cache, k, v, slots: np.ndarray) -> bool:
    """The native row store (``slots`` int64, already checked against the row counts);
    False, nothing written, where the library is unavailable."""
    from kvpage.kernels import native_cpu

    lib = native_cpu.library()
    if lib is None:
        return False
    for cache, rows in ((key_cache, k), (value_cache, v)):
        rows = rows.to(cache.dtype)
        if rows.shape[1:] != cache.shape[2:]:
            raise ValueError(f"K/V rows of shape {tuple(rows.shape[1:])} do not fit cache rows "
                             f"{tuple(cache.shape[2:])}")
        if rows.stride(2) != 1:
            rows = rows.contiguous()
        native_cpu.store_rows(lib, cache.data_ptr(), tuple(cache.shape), cache.element_size(), rows.data_ptr(),
                              rows.stride()[:2], slots)
    return True


def _store_numba(key_cache, value_cache, k, v, slots: np.ndarray) -> None:
    from kvpage.attention.numba_cpu import store_kv_numba

    rows = [_numba_view(x.to(key_cache.dtype).contiguous()) for x in (k, v)]
    store_kv_numba(_numba_view(key_cache), _numba_view(value_cache), *rows, slots)
