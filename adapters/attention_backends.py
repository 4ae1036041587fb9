"""Attention backends the HF adapter can run on, behind one small protocol
(``forward_context.AttentionBackend``: ``prepare`` once per step, then ``write_kv`` and
``attention`` per layer), registered by name.

``cpu`` is the fast CPU path, ``cuda`` the Numba kernels on GPU (prefill rows of bf16
models through a gather into torch's SDPA, ``cuda_prefill``; decode steps replayable from
CUDA graphs, ``prepare_graphed``), and ``reference`` the numpy oracle (slow; for checking). Every size a backend needs (``num_decodes``,
``max_prefill_query_len``, ...) is read from the ``StepMetadata``, never recomputed.
Other backends join with ``register_attention_backend(name, factory)``.

A KV cache of a quantized format (``kv_cache_dtype`` fp8, int8, int4: uint8 ``[num_blocks,
block_bytes]`` buffers, ``kvpage.core.kv_formats``) is a backend's to read: ``select_backend``
hands the ``CacheFormat`` to the factory, and all three built-in backends take every format.
Where the format stores heads rotated (fp8, int4), the backend comes wrapped in ``RotatedBackend``.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from kvpage.attention.cpu import CPUAttention, CPUKernelChoice
from kvpage.attention.cpu_metadata import CPUAttentionMetadata, LayerCall, prepare_cpu_attention_metadata
from kvpage.attention.reference import paged_attention_reference, quantized, write_kv_reference
from kvpage.core.kv_formats import CacheFormat
from kvpage.core.sched.metadata import StepMetadata

from .cuda_prefill import HostStep, attend_decodes_then_sdpa, check_prefill_kernel, choose_prefill_kernel
from .decode_graphs import GraphedStepIndices
from .forward_context import AttentionBackend
from .rotated_backend import RotatedBackend


@dataclass(slots=True)
class ReferenceStep:
    """The step's metadata (numpy index arrays) plus its slot mapping as a torch tensor."""

    metadata: StepMetadata
    slot_mapping: torch.Tensor  # int64 [T]


def _as_f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 buffer as numpy: zero-copy on the CPU (writes land in the tensor), else a host copy."""
    return t.detach().cpu().numpy()


class ReferenceBackend:
    """The numpy reference, through float32 copies (a quantized cache: its bytes, read and
    written in place on the CPU). Exact semantics, no speed."""

    name = "reference"

    def __init__(self, device: torch.device, cache_format: Optional[CacheFormat] = None) -> None:
        self.device = device
        self.cache_format = quantized(cache_format)

    def prepare(self, metadata: StepMetadata) -> ReferenceStep:
        return ReferenceStep(metadata, torch.as_tensor(metadata.slot_mapping, dtype=torch.int64, device=self.device))

    def write_kv(self, key_cache, value_cache, k, v, prepared: ReferenceStep) -> None:
        fmt = self.cache_format
        if fmt is not None and key_cache.device.type == "cpu":
            write_kv_reference(_as_bytes(key_cache), _as_bytes(value_cache), _as_f32(k), _as_f32(v),
                               prepared.metadata.slot_mapping, fmt)
            return
        from kvpage.attention.torch_cpu import write_kv_torch  # a quantized GPU cache: the same bytes, scattered

        write_kv_torch(key_cache, value_cache, k, v, prepared.slot_mapping, fmt)

    def attention(self, q, key_cache, value_cache, prepared: ReferenceStep, scaling: float,
                  sliding_window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor],
                  attention_chunk: Optional[int] = None, alibi_slopes: Optional[torch.Tensor] = None):
        md = prepared.metadata
        caches = _as_f32 if self.cache_format is None else _as_bytes
        out = paged_attention_reference(
            _as_f32(q), caches(key_cache), caches(value_cache), md.query_start_loc, md.seq_lens, md.block_tables,
            scaling, sliding_window, softcap, None if sinks is None else _as_f32(sinks),
            attention_chunk=attention_chunk, alibi_slopes=None if alibi_slopes is None else _as_f32(alibi_slopes),
            cache_format=self.cache_format,
        )
        return torch.from_numpy(out).to(device=q.device, dtype=q.dtype)


class CpuBackend:
    """The CPU kernels (``kvpage.attention.cpu``): each attention site's native, numba or
    torch kernels chosen once, on the site's first call, under ``choice``, for buffers of
    ``cache_format`` (None: values of the buffers' dtype). ``batch_invariant`` (the engine's
    ``EngineConfig.batch_invariant``) makes the choice ``schedule_invariant``."""

    name = "cpu"

    def __init__(self, device: torch.device, cache_format: Optional[CacheFormat] = None,
                 choice: CPUKernelChoice = CPUKernelChoice(), *, batch_invariant: bool = False) -> None:
        self.device = device
        self.cache_format = quantized(cache_format)
        if batch_invariant:
            choice = dataclasses.replace(choice, schedule_invariant=True)
        self.site_kernels = CPUAttention(choice, self.cache_format)  # bound on each site's first call

    def prepare(self, metadata: StepMetadata) -> CPUAttentionMetadata:
        return prepare_cpu_attention_metadata(metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
                                              slot_mapping=metadata.slot_mapping, num_decodes=metadata.num_decodes)

    def write_kv(self, key_cache, value_cache, k, v, prepared: CPUAttentionMetadata) -> None:
        if prepared.slot_mapping is None:
            raise ValueError("the step's metadata has no slot_mapping to write K/V rows to")
        self.site_kernels.store(key_cache, value_cache)(key_cache, value_cache, k, v, prepared.slot_mapping)

    def attention(self, q, key_cache, value_cache, prepared: CPUAttentionMetadata, scaling: float,
                  sliding_window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor],
                  attention_chunk: Optional[int] = None, alibi_slopes: Optional[torch.Tensor] = None):
        call = LayerCall(scaling, sliding_window, softcap, sinks, attention_chunk, alibi_slopes)
        return self.site_kernels.kernels(q, key_cache, value_cache).attend(q, key_cache, value_cache, prepared, call)

    def write_and_attend(self, q, k, v, key_cache, value_cache, prepared: CPUAttentionMetadata, scaling: float,
                         sliding_window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor],
                         write: bool = True):
        return self.site_kernels.kernels(q, key_cache, value_cache).write_and_attend(
            q, k, v, key_cache, value_cache, prepared, LayerCall(scaling, sliding_window, softcap, sinks), write)


@dataclass(slots=True)
class CudaIndices:
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    max_prefill_query_len: int
    max_seq_len: int
    host: Optional[HostStep] = None  # the step on the host, for the SDPA prefill (None: never prefills)


class CudaBackend:
    """Numba CUDA kernels (``kvpage.cuda``) on the caller's current torch stream."""

    name = "cuda"

    def __init__(self, device: torch.device, cache_format: Optional[CacheFormat] = None,
                 prefill_kernel: str = "auto") -> None:
        if device.type != "cuda":
            raise ValueError("the 'cuda' attention backend needs the model on a CUDA device")
        self.device = device
        self.cache_format = quantized(cache_format)
        check_prefill_kernel(prefill_kernel, self.cache_format)
        self.prefill_kernel = prefill_kernel  # "auto" | "numba" | "sdpa" (``cuda_prefill``)
        # kvpage.cuda's calls take the format only for a quantized cache.
        self._format = {} if self.cache_format is None else {"cache_format": self.cache_format}

    def prepare(self, metadata: StepMetadata) -> CudaIndices:
        as_dev = lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dt).to(self.device, non_blocking=True)  # noqa: E731
        return CudaIndices(as_dev(metadata.slot_mapping, torch.int64), as_dev(metadata.query_start_loc, torch.int32),
                           as_dev(metadata.seq_lens, torch.int32), as_dev(metadata.block_tables, torch.int32),
                           metadata.num_decodes, metadata.max_prefill_query_len, metadata.max_seq_len,
                           HostStep(metadata))

    def prepare_graphed(self, indices: GraphedStepIndices) -> CudaIndices:
        """A captured decode step's view (``decode_graphs``): the persistent buffers as they
        are, every row a decode, launches sized for ``indices.max_seq_len``."""
        return CudaIndices(indices.slot_mapping, indices.query_start_loc, indices.seq_lens, indices.block_tables,
                           indices.num_seqs, 0, indices.max_seq_len)

    def write_kv(self, key_cache, value_cache, k, v, prepared: CudaIndices) -> None:
        from kvpage.cuda import store_kv

        store_kv(key_cache, value_cache, k.contiguous(), v.contiguous(), prepared.slot_mapping, **self._format)

    def attention(self, q, key_cache, value_cache, prepared: CudaIndices, scaling: float,
                  sliding_window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor],
                  attention_chunk: Optional[int] = None, alibi_slopes: Optional[torch.Tensor] = None):
        from kvpage.cuda import paged_attention

        if attention_chunk or alibi_slopes is not None:
            raise ValueError("the CUDA kernels do not implement chunked attention or ALiBi (use device='cpu')")
        has_prefill = prepared.max_prefill_query_len > 0 and prepared.num_decodes < prepared.seq_lens.shape[0]
        if has_prefill and choose_prefill_kernel(self.prefill_kernel, q.dtype, self.cache_format, softcap,
                                                 sinks) == "sdpa":
            if prepared.host is None:
                raise ValueError("the SDPA prefill needs the step's host metadata (CudaBackend.prepare's)")
            return attend_decodes_then_sdpa(q.contiguous(), key_cache, value_cache, (
                prepared.query_start_loc, prepared.seq_lens, prepared.block_tables), prepared.host, scaling,
                sliding_window)
        return paged_attention(q.contiguous(), key_cache, value_cache, prepared.query_start_loc, prepared.seq_lens,
                               prepared.block_tables, scaling, sliding_window, softcap,
                               None if sinks is None else sinks.detach().float().contiguous(),
                               num_decodes=prepared.num_decodes,
                               max_prefill_query_len=prepared.max_prefill_query_len,
                               max_seq_len=prepared.max_seq_len, **self._format)


#: ``factory(device)``, or for a quantized KV cache ``factory(device, cache_format)``.
BackendFactory = Callable[..., AttentionBackend]
_REGISTRY: dict[str, BackendFactory] = {}


def register_attention_backend(name: str, factory: BackendFactory) -> None:
    """Make ``factory(device)`` selectable as ``attention_backend=name`` (replaces a same-named one).
    A factory that reads quantized KV caches also takes ``factory(device, cache_format)``
    (a quantized :class:`~kvpage.core.kv_formats.CacheFormat`) and raises ``ValueError``
    for a format it cannot read."""
    if not name or name == "auto":
        raise ValueError(f"a backend cannot be registered as {name!r}")
    _REGISTRY[name] = factory


def attention_backend_names() -> list[str]:
    return ["auto", *_REGISTRY]


def select_backend(name: str, device: torch.device, cache_format: Optional[CacheFormat] = None,
                   batch_invariant: bool = False) -> AttentionBackend:
    """The backend registered as ``name``; ``"auto"`` is ``cuda`` on a GPU and ``cpu`` otherwise.

    ``cache_format``: the KV buffers' (``KVCacheSpec.cache_format``). None or unquantized:
    ``factory(device)``; quantized: ``factory(device, cache_format)``, and ``ValueError``
    (one line) where the backend cannot read that format. ``batch_invariant``: a factory
    with a ``batch_invariant`` keyword gets it; one without is a ``ValueError``.
    """
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "cpu"
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {attention_backend_names()}")
    if batch_invariant:
        if not _takes_keyword(factory, "batch_invariant"):
            raise ValueError(f"attention backend {name!r} has no batch-invariant mode (batch_invariant runs on the "
                             f"CPU backend)")
        factory = functools.partial(factory, batch_invariant=True)
    fmt = quantized(cache_format)
    if fmt is None:
        return factory(device)
    if not _takes_two_arguments(factory):
        raise ValueError(f"attention backend {name!r} cannot read kv_cache_dtype {fmt.kv_format.name} "
                         f"KV caches; use an unquantized one or another backend")
    backend = factory(device, fmt)
    return RotatedBackend(backend) if fmt.kv_format.rotated else backend


def _takes_keyword(factory: BackendFactory, name: str) -> bool:
    try:
        return name in inspect.signature(factory).parameters
    except ValueError:  # no signature to read (a builtin)
        return False


def _takes_two_arguments(factory: BackendFactory) -> bool:
    """Whether ``factory(device, cache_format)`` binds (a factory of the device alone does not)."""
    try:
        inspect.signature(factory).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): let the call tell
        return True
    return True


register_attention_backend("cpu", CpuBackend)
register_attention_backend("cuda", CudaBackend)
register_attention_backend("reference", ReferenceBackend)
