"""Numba CUDA kernels over paged KV buffers (import name ``kvpage.cuda``).

Public entry points (same contract as ``kvpage.attention.reference``):

* ``store_kv(key_cache, value_cache, k, v, slot_mapping, cache_format=None, *, stream=None)``
* ``paged_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
  scaling, sliding_window=None, softcap=None, sinks=None, *, num_splits=None, stream=None,
  decode_kernel="auto", cache_format=None, ...)``: decodes run on the fast kernel
  (``decode_fast``) where it supports the shape on a real GPU, else on the reference kernels
  (``decode_kernels``, ``attention_kernels``), which also run under the simulator.

``cache_format`` (a quantized ``kvpage.core.kv_formats.CacheFormat``: fp8_e4m3, fp8_e5m2,
int8, int4) makes the caches uint8 ``[num_blocks, block_bytes]`` buffers: ``store_kv``
quantizes rows into them (``quant_store``, byte-identical to ``kv_quant.quantize_rows``) and
the kernels dequantize each K/V element as they load it (the reference ones through
``quant_load``; int8 and fp8 decodes take the fast kernel too, through ``fast_rows``).

Importing this package never touches a GPU and imports neither numba nor cupy nor torch:
the wrappers load on first attribute access and kernels compile on first launch.
Module names here avoid ``bindings``/``core``/``pathfinder`` (NVIDIA's ``cuda.*`` namespace).
"""
from __future__ import annotations

from typing import Any

if __name__ == "cuda":
    # Imported as top-level ``cuda`` because the repository root is on sys.path
    # (``python -m pytest`` / ``python -c`` from the root). Then this directory shadows
    # NVIDIA's ``cuda`` namespace package (``cuda.bindings``, ``cuda.pathfinder``) that
    # numba-cuda and CuPy import; joining the other ``cuda/`` directories on sys.path
    # to this package's search path makes those imports resolve as usual.
    from pkgutil import extend_path

    __path__ = extend_path(__path__, __name__)

__all__ = ["store_kv", "paged_attention"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import ops

        return getattr(ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
