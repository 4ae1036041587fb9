"""What one CPU attention call reads: the step's index arrays (converted once per step) and one layer's arguments.

Torch-, numba- and backend-free: :mod:`~kvpage.attention.cpu` and the backends it binds
(:mod:`~kvpage.attention.numba_cpu`, :mod:`~kvpage.attention.torch_cpu`,
:mod:`~kvpage.attention.cpu_kernels`) import this module, and it imports none of them.

Per step, build one :class:`CPUAttentionMetadata` (:func:`prepare_cpu_attention_metadata`)
and pass it to every layer: index arrays are converted (int32 for the kernels, int64
tensors for torch on first use), the decode/prefill split is known, and the numba work
tiles and the native kernel's step arguments are built once, not per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

import numpy as np

from kvpage.core.sched.metadata import leading_decodes

if TYPE_CHECKING:
    import torch

    Array = Union[np.ndarray, torch.Tensor]

#: Query rows per numba prefill work item. Decode sequences are always a tile of one row.
PREFILL_TILE = 16

#: Element types the native and numba kernels read, by dtype (torch's and numpy's names)
#: to the name they take (``cache_dtype``, ``native_cpu.ELEM_TYPES``).
_KERNEL_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
                  "float32": "float32", "float16": "float16"}


def kernel_dtype_name(dtype) -> Optional[str]:
    """``dtype``'s (torch or numpy) kernel element type, or None for one no kernel reads."""
    return _KERNEL_DTYPES.get(str(dtype))


def is_torch(x) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch)."""
    return type(x).__module__.startswith("torch")


def to_numpy(a: "Array", dtype) -> np.ndarray:
    """``a`` (numpy, torch, or a sequence) as a C-contiguous numpy array of ``dtype``."""
    if hasattr(a, "detach"):  # a torch tensor; no torch import needed to convert it
        a = a.detach().cpu().numpy()
    return np.ascontiguousarray(a, dtype=dtype)


def decodes_of(query_start_loc: "Array", num_decodes: Optional[int]) -> int:
    """``num_decodes`` as given (a ``StepMetadata`` carries it), else the leading run of
    query-length-1 sequences by the metadata's own rule."""
    if num_decodes is not None:
        return int(num_decodes)
    return leading_decodes(np.diff(np.asarray(query_start_loc, dtype=np.int64)))


def build_work_tiles(query_start_loc: np.ndarray, first_seq: int = 0, tile: int = PREFILL_TILE) -> np.ndarray:
    """Split the query rows of sequences ``first_seq:`` into tiles of at most ``tile`` rows.

    Returns int32 ``[W, 3]`` rows ``(seq, row_start, row_end)`` (rows relative to the
    sequence's first query). Empty sequences get no tile. Vectorized, no per-token loop.
    """
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    q_lens = np.diff(qsl)[first_seq:]
    n_tiles = -(-q_lens // tile)
    seq = np.repeat(np.arange(q_lens.shape[0], dtype=np.int64), n_tiles)
    first_tile = np.cumsum(n_tiles) - n_tiles
    start = (np.arange(seq.shape[0], dtype=np.int64) - first_tile[seq]) * tile
    end = np.minimum(start + tile, q_lens[seq])
    return np.ascontiguousarray(np.stack([seq + first_seq, start, end], axis=1).astype(np.int32))


@dataclass(slots=True)
class LayerCall:
    """One layer's attention arguments (constant per layer, passed with every call).

    ``scaling`` multiplies q.k; ``sliding_window`` (tokens), ``softcap``, ``sinks``
    (``[H]`` logits, torch or numpy), ``attention_chunk`` (tokens, Llama 4) and
    ``alibi_slopes`` (``[H]``, Bloom, MPT) as in :mod:`kvpage.attention`; None is off.
    """

    scaling: float
    sliding_window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: Optional["Array"] = None
    attention_chunk: Optional[int] = None
    alibi_slopes: Optional["Array"] = None
    _sinks_f32: Optional[np.ndarray] = field(default=None, init=False, repr=False)

    @property
    def is_variant(self) -> bool:
        """Chunked attention or ALiBi: masks only the torch backend and the reference apply."""
        return bool(self.attention_chunk) or self.alibi_slopes is not None

    def sinks_f32(self) -> Optional[np.ndarray]:
        """``sinks`` as contiguous float32 numpy (what the native and numba kernels read), or None."""
        if self.sinks is not None and self._sinks_f32 is None:
            sinks = self.sinks
            self._sinks_f32 = to_numpy(sinks.float() if is_torch(sinks) else sinks, np.float32)
        return self._sinks_f32


@dataclass(slots=True)
class CPUAttentionMetadata:
    """Index arrays of one step, converted once for all layers.

    Attributes:
        query_start_loc: int32 [B + 1].
        seq_lens: int32 [B] context length per sequence (tokens).
        block_tables: int32 [B, max_blocks], C-contiguous.
        num_decodes: leading sequences with query length 1.
        slot_mapping: int64 [T] flat KV slots for the K/V writes, or None.
        decode_only: every sequence decodes (the fused native write-and-attend may serve).
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    num_decodes: int
    slot_mapping: Optional[np.ndarray] = None
    decode_only: bool = field(init=False)
    _work: Optional[np.ndarray] = field(default=None, init=False, repr=False)
    _torch: dict = field(default_factory=dict, init=False, repr=False)
    _native: dict = field(default_factory=dict, init=False, repr=False)
    _slots_address: Optional[int] = field(default=None, init=False, repr=False)
    _as_prompts: Optional["CPUAttentionMetadata"] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.decode_only = self.num_decodes == self.seq_lens.shape[0]

    def as_prompt_rows(self) -> "CPUAttentionMetadata":
        """This step with every sequence, decodes included, as a prompt of its query rows
        (``num_decodes`` 0), so that a prefill phase computes them all; made once per step."""
        if self._as_prompts is None:
            self._as_prompts = CPUAttentionMetadata(self.query_start_loc, self.seq_lens, self.block_tables, 0,
                                                    self.slot_mapping)
        return self._as_prompts

    @property
    def work(self) -> np.ndarray:
        """Numba prefill work tiles of the sequences after the decodes (built on first use)."""
        if self._work is None:
            self._work = build_work_tiles(self.query_start_loc, self.num_decodes)
        return self._work

    @property
    def slots_address(self) -> int:
        """The address of ``slot_mapping`` (valid while this metadata lives)."""
        if self._slots_address is None:
            self._slots_address = self.slot_mapping.ctypes.data
        return self._slots_address

    def decode_splits(self, num_threads: int, block_size: int) -> int:
        """Context splits per decode sequence (``numba_decode.decode_splits``), once per step."""
        return self.native_step(num_threads, block_size)[4]

    def native_step(self, num_threads: int, block_size: int) -> tuple[int, int, int, int, int]:
        """The step's arguments of :func:`native_cpu.write_decode`: (tables address, table
        row stride, seq_lens address, decodes, splits); addresses stay valid while this
        metadata lives. Built once per (thread count, block size)."""
        key = (num_threads, block_size)
        step = self._native.get(key)
        if step is None:
            from kvpage.kernels.numba_decode import decode_splits

            longest = int(self.seq_lens[:self.num_decodes].max()) if self.num_decodes else 0
            splits = decode_splits(self.num_decodes, longest, block_size, num_threads)
            step = (self.block_tables.ctypes.data, self.block_tables.strides[0] // 4, self.seq_lens.ctypes.data,
                    self.num_decodes, splits)
            self._native[key] = step
        return step

    def torch_index(self, name: str) -> "torch.Tensor":
        """``name``'s array as an int64 CPU tensor, converted on first use."""
        if name not in self._torch:
            import torch

            self._torch[name] = torch.from_numpy(getattr(self, name).astype(np.int64))
        return self._torch[name]


def prepare_cpu_attention_metadata(query_start_loc: "Array", seq_lens: "Array", block_tables: "Array",
                                   slot_mapping: Optional["Array"] = None,
                                   num_decodes: Optional[int] = None) -> CPUAttentionMetadata:
    """Build the per-step metadata from numpy or torch index arrays (see module docstring).

    ``num_decodes`` comes from ``StepMetadata.num_decodes``; standalone callers may omit it.
    Raises ``ValueError`` for inconsistent shapes or a sequence with more queries than context.
    """
    qsl = to_numpy(query_start_loc, np.int32)
    lens = to_numpy(seq_lens, np.int32)
    tables = to_numpy(block_tables, np.int32)
    if qsl.ndim != 1 or lens.shape != (qsl.shape[0] - 1,) or tables.ndim != 2 or tables.shape[0] != lens.shape[0]:
        raise ValueError(f"inconsistent metadata shapes: query_start_loc {qsl.shape}, seq_lens {lens.shape}, "
                         f"block_tables {tables.shape}")
    if np.any(np.diff(qsl) > lens):
        raise ValueError("a sequence has more queries than context tokens (query_start_loc vs seq_lens)")
    slots = None if slot_mapping is None else to_numpy(slot_mapping, np.int64)
    return CPUAttentionMetadata(qsl, lens, tables, decodes_of(qsl, num_decodes), slots)
