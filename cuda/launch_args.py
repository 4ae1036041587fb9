"""Kernel arguments of one ``paged_attention`` call, shared by its decode and prefill launches.

Metadata and flags are converted once per call; q, the caches and ``out`` are wrapped as
float arrays only when a reference kernel runs (the fast decode kernel takes their bits, see
``fast_dispatch``), so a torch bf16 call never builds a float view Numba cannot type.
Unused partials and absent sinks are the ``workspace``'s cached 1-element arrays.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .interop import as_kernel_arg, empty_like_kind
from .workspace import Workspace


def meta_arg(x: Any, dtype: Any, stream: Any) -> Any:
    """Kernel argument for a metadata array; host arrays are normalised to ``dtype`` first."""
    if isinstance(x, np.ndarray):
        x = np.ascontiguousarray(x, dtype=dtype)
    return as_kernel_arg(x, stream)


def float_arg(x: Any, stream: Any) -> Any:
    """Kernel argument for a small float array (host arrays become contiguous float32)."""
    if isinstance(x, np.ndarray):
        x = np.ascontiguousarray(x, dtype=np.float32)
    return as_kernel_arg(x, stream)


class LaunchArgs:
    """One call's kernel arguments: ``meta`` = (query_start_loc, seq_lens, block_tables) int32,
    ``flags`` = (scaling, window, softcap, sinks, has_sinks) as every attention kernel takes them."""

    def __init__(self, arrays: tuple, meta: tuple, flags: tuple, stream: Any, threads: int,
                 workspace: Workspace) -> None:
        self.arrays = arrays  # (q, key_cache, value_cache, out) as the caller's library holds them
        self.meta, self.flags, self.stream, self.threads, self.workspace = meta, flags, stream, threads, workspace
        self._common = None

    @classmethod
    def build(cls, arrays: tuple, metadata: tuple, sinks: Any, scaling: float, window: int, cap: float,
              stream: Any, threads: int, workspace: Workspace) -> "LaunchArgs":
        meta = tuple(meta_arg(a, np.int32, stream) for a in metadata)
        if sinks is None:
            sinks_arg, has_sinks = workspace.dummy(1), 0
        else:
            sinks_arg, has_sinks = float_arg(sinks, stream), 1
        return cls(arrays, meta, (scaling, window, cap, sinks_arg, has_sinks), stream, threads, workspace)

    @property
    def common(self) -> tuple:
        """(q, key_cache, value_cache, out) as float kernel arguments (built on first use)."""
        if self._common is None:
            self._common = tuple(as_kernel_arg(a, self.stream) for a in self.arrays)
        return self._common

    def _no_parts(self) -> tuple:
        # Unused partial buffers still need the right rank/dtype: one compiled variant serves both modes.
        return self.workspace.dummy(3), self.workspace.dummy(3), self.workspace.dummy(4)

    def _scratch(self, shape: tuple) -> Any:
        return as_kernel_arg(empty_like_kind(self.arrays[0], shape, np.float32, self.stream), self.stream)

    def decode(self, kernel, merge_kernel, num_decodes: int, num_kv_heads: int, num_heads: int, head_dim: int,
               splits: int, partition: int) -> None:
        """Reference split-K decode over ``splits`` context partitions, merged by log-sum-exp when > 1."""
        q, k, v, out = self.common
        grid = (num_decodes, num_kv_heads, splits)
        if splits == 1:
            kernel[grid, self.threads, self.stream](q, k, v, *self.meta, *self.flags, partition, 0, out,
                                                    *self._no_parts())
            return
        part_max = self._scratch((num_decodes, num_heads, splits))
        part_sum = self._scratch((num_decodes, num_heads, splits))
        part_acc = self._scratch((num_decodes, num_heads, splits, head_dim))
        kernel[grid, self.threads, self.stream](q, k, v, *self.meta, *self.flags, partition, 1, out,
                                                part_max, part_sum, part_acc)
        merge_threads = min(self.threads, head_dim)
        sinks_arg, has_sinks = self.flags[3], self.flags[4]
        merge_kernel(head_dim, merge_threads)[(num_decodes, num_heads), merge_threads, self.stream,
                                               4 * (splits + 1)](
            part_max, part_sum, part_acc, splits, sinks_arg, has_sinks, 0, out)

    def prefill(self, kernel, num_blocks: int, num_kv_heads: int, first_seq: int, row_tiles: int,
                partition: int) -> None:
        """Prefill/chunk rows of the sequences from ``first_seq`` on, ``row_tiles`` blocks each."""
        q, k, v, out = self.common
        grid = (num_blocks, num_kv_heads, 1)
        kernel[grid, self.threads, self.stream](q, k, v, *self.meta, first_seq, row_tiles, *self.flags, partition, 0,
                                                out, *self._no_parts())
