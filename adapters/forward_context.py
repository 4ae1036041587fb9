"""The forward the model is running now: what its attention calls read, bound for that forward only.

The runner builds one context per forward: a ``StepContext`` for a real step, a
``ProbeContext`` for a forward with attention stubbed out (KV layouts, memory, compilation).
It binds the context with ``forward_context(context)`` for exactly that forward, and every
piece of kvpage code that runs inside the forward finds it with ``current_forward_context()``:
the attention function and its mask builder (``hf_attention``), the compiled graph's custom
op (``paged_attention_op``) and the DSA indexer ports (``sparse_indexer``). Nothing else
carries it: no keyword argument, so a model that drops ``**kwargs`` on the way to attention
behaves the same. A ``ContextVar`` holds it, reset when the forward ends (an exception
included) and never seen by another thread.

KV buffers belong to attention *call sites* (``AttentionSite``): one per layer, or more
where a layer calls attention more than once per forward (differential attention calls it
twice, with two halves of V; a DSA indexer stores its keys as one more site of its layer),
or a module shared by several layers (Zamba's shared attention block: layer -1). Sites are
numbered by layer, then by call order within the layer; that is the KV cache's layer order.
A forward makes its attention calls in the order the probe saw them, so a step finds the
site of its ``i``-th call at ``StepContext.calls[i]``.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Protocol, Sequence, Union

import torch

from kvpage.core.sched.metadata import StepMetadata
from kvpage.storage.spec import LayerKVSpec


class AttentionBackend(Protocol):
    """What a step context needs from an attention backend; see ``attention_backends``."""

    name: str

    def prepare(self, metadata: StepMetadata) -> Any:
        """Turn the step's metadata into what the backend reads per layer (once per step)."""

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 prepared: Any) -> None:
        """Scatter the step's new K/V rows ``[T, H_kv, D]`` into the layer's buffers by slot."""

    def attention(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, prepared: Any,
                  scaling: float, sliding_window: Optional[int], softcap: Optional[float],
                  sinks: Optional[torch.Tensor], attention_chunk: Optional[int] = None,
                  alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Paged attention of ``q`` ``[T, H, D]`` over each sequence's context; ``[T, H, D]``.
        ``attention_chunk`` (chunked attention, Llama 4) and ``alibi_slopes`` (``[H]``
        float32, ALiBi: Bloom, MPT) are passed only for such layers; a backend that cannot
        apply them raises ``ValueError``."""

    # Optional: ``write_and_attend(q, k, v, key_cache, value_cache, prepared, scaling,
    # sliding_window, softcap, sinks, write=True)``, ``write_kv`` (unless ``write`` is False)
    # then ``attention`` in one call, for backends that can fuse the two (the CPU backend's
    # decode steps); the context calls it instead of the pair when a backend has it.


@dataclass(slots=True)
class AttentionSite:
    """One attention call site. ``spec`` is its KV layout (a site that reads another's KV has
    ``spec.reuses`` set and holds its owner's buffers). Once the runner binds the KV cache:
    ``key_cache``/``value_cache`` ``[num_blocks, block_size, heads, head_dim]`` (K and V may
    differ in heads and head size), ``group`` its KV group (its block tables and slot mapping
    with hybrid groups, else 0) and ``alibi_slopes`` float32 ``[heads]`` for an ALiBi layer."""

    layer: int  # -1: a module shared by several layers
    spec: LayerKVSpec
    group: int = 0
    key_cache: Optional[torch.Tensor] = None
    value_cache: Optional[torch.Tensor] = None
    alibi_slopes: Optional[torch.Tensor] = None

    @property
    def writes(self) -> bool:
        """Whether the site stores its own K/V (else it reads an earlier site's)."""
        return self.spec.reuses is None


@dataclass(slots=True)
class StepContext:
    """A real step's forward. ``calls[i]`` is the site of the forward's ``i``-th attention
    call (bound: buffers set); ``prepared[g]`` is the backend's view of the step for KV group
    ``g`` (one entry without hybrid groups); ``metadata`` the step's, for sites that read it
    whole (selected-key attention, DSA indexers; None in a forward captured for replay,
    whose steps such sites never run). Rows past ``num_real_tokens`` are compile
    padding. ``layers_called`` counts the forward's calls, so the runner can tell whether
    some call bypassed kvpage attention."""

    calls: Sequence[AttentionSite]
    backend: AttentionBackend
    prepared: Sequence[Any]
    metadata: Optional[StepMetadata]
    num_real_tokens: int
    mask_placeholder: bool = False  # hand the model ``MASK_PLACEHOLDER`` for its mask (see hf_attention)
    layers_called: int = 0

    def next_site(self, layer: int) -> AttentionSite:
        """The site of the forward's next call, made by layer ``layer`` (counted)."""
        index = self.layers_called
        self.layers_called += 1
        site = self.calls[index] if index < len(self.calls) else None
        if site is None or site.layer != layer:
            raise RuntimeError(f"attention call {index} of this forward came from layer {layer}; the probe saw "
                               f"{'no such call' if site is None else f'layer {site.layer}'} there")
        return site

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
               sliding_window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor],
               key_selection: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write the call site's new K/V (unless it reads another site's), then attend;
        tensors are ``[T, heads, D]``, the result ``[T, H, D_v]``. ``key_selection`` (DSA:
        ``[T, K]`` key positions per query, -1 none) restricts each query to those keys."""
        site = self.next_site(layer)
        prepared = self.prepared[site.group]
        backend = self.backend
        if key_selection is not None:
            return self._attend_selected(site, q, k, v, prepared, scaling, softcap, sinks, key_selection)
        chunk = site.spec.attention_chunk
        if chunk or site.alibi_slopes is not None:  # only some backends mask by chunks or add ALiBi
            if site.writes:
                backend.write_kv(site.key_cache, site.value_cache, k, v, prepared)
            extra = {"attention_chunk": chunk} if chunk else {}
            if site.alibi_slopes is not None:
                extra["alibi_slopes"] = site.alibi_slopes
            return backend.attention(q, site.key_cache, site.value_cache, prepared, scaling, sliding_window, softcap,
                                     sinks, **extra)
        fused = getattr(backend, "write_and_attend", None)
        if fused is not None:
            return fused(q, k, v, site.key_cache, site.value_cache, prepared, scaling, sliding_window, softcap, sinks,
                         write=site.writes)
        if site.writes:
            backend.write_kv(site.key_cache, site.value_cache, k, v, prepared)
        return backend.attention(q, site.key_cache, site.value_cache, prepared, scaling, sliding_window, softcap,
                                 sinks)

    def _attend_selected(self, site: AttentionSite, q, k, v, prepared, scaling: float, softcap: Optional[float],
                         sinks: Optional[torch.Tensor], key_selection: torch.Tensor) -> torch.Tensor:
        from kvpage.attention.torch_cpu import selected_attention_torch

        fmt = getattr(self.backend, "cache_format", None)
        if fmt is not None:  # a quantized cache: these rows are bytes selected attention cannot read
            raise ValueError(f"sparse (selected-key) attention reads unquantized KV caches only, not "
                             f"kv_cache_dtype {fmt.kv_format.name}")
        if site.writes:
            self.backend.write_kv(site.key_cache, site.value_cache, k, v, prepared)
        md = self.metadata
        return selected_attention_torch(q, site.key_cache, site.value_cache, md.query_start_loc, md.seq_lens,
                                        md.block_tables, key_selection, scaling, softcap, sinks)


@dataclass
class ProbeContext:
    """A forward with attention stubbed out: records each attention call's KV layout and dtype.

    ``calls`` holds ``(layer, LayerKVSpec)`` in call order (a layer may call attention more
    than once), with the sliding window the model passed to the call. ``foreign_calls``
    lists ``(layer, rows)`` for calls whose K/V rows are not the forward's tokens (a module
    attending across layer outputs rather than across the sequence). ``layers_with_masks``
    lists the layers handed an attention mask or bias of the model's own making: kvpage
    derives causality from positions and builds no mask, so a mask that reaches attention
    anyway carries something else (a learned bias, a dynamic sparsity mask). With
    ``track_sharing``, a call handed the very K and V tensors an earlier call was handed
    reuses that call's KV (cross-layer sharing, e.g. Gemma3n); the probe then keeps every
    K/V it saw alive, so equal storage means the same tensor, not a freed address handed
    out again (which is why memory-profiling probes leave it off).
    """

    calls: list = field(default_factory=list)  # (layer index, LayerKVSpec with reuses = call index)
    dtype: Optional[torch.dtype] = None
    layers_called: int = 0
    num_real_tokens: Optional[int] = None
    track_sharing: bool = False
    record_query: bool = False
    first_query: Optional[torch.Tensor] = None  # the first call's q [T, H, D], with record_query
    layers_with_masks: set = field(default_factory=set)
    foreign_calls: list = field(default_factory=list)
    mask_placeholder: bool = False  # as StepContext's
    _seen: dict = field(default_factory=dict)  # (k storage, v storage) -> first call handed them
    _alive: list = field(default_factory=list)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: Any = None,
               sliding_window: Optional[int] = None, *args: Any, key_selection: Optional[torch.Tensor] = None,
               attention_chunk: Optional[int] = None) -> torch.Tensor:
        self.layers_called += 1
        index = len(self.calls)
        if self.num_real_tokens is not None and k.shape[0] != self.num_real_tokens:
            self.foreign_calls.append((layer, int(k.shape[0])))
        if self.record_query and index == 0:
            self.first_query = q.detach().clone()
        owner = index
        if self.track_sharing:
            owner = self._seen.setdefault((_storage_key(k), _storage_key(v)), index)
            self._alive.append((k, v))
        self.calls.append((layer, LayerKVSpec(int(k.shape[1]), int(k.shape[2]), int(v.shape[1]), int(v.shape[2]),
                                              reuses=None if owner == index else owner,
                                              sliding_window=int(sliding_window) if sliding_window else None,
                                              attention_chunk=attention_chunk)))
        self.dtype = k.dtype
        return q.new_zeros((*q.shape[:-1], v.shape[-1]))

    def record_site(self, layer: int, spec: LayerKVSpec, dtype: torch.dtype) -> None:
        """A call site that stores rows without attending (a DSA indexer's keys)."""
        self.layers_called += 1
        self.calls.append((layer, spec))
        self.dtype = dtype

    def site_layout(self) -> tuple[list[AttentionSite], list[int]]:
        """The sites in site order (by layer, then call order; ``reuses`` renumbered to site
        indices), and the site of each call in call order."""
        order = sorted(range(len(self.calls)), key=lambda i: (self.calls[i][0], i))
        site_of = {call: site for site, call in enumerate(order)}
        sites = []
        for call in order:
            layer, spec = self.calls[call]
            if spec.reuses is not None:
                spec = dataclasses.replace(spec, reuses=site_of[spec.reuses])
            sites.append(AttentionSite(layer, spec))
        return sites, [site_of[call] for call in range(len(self.calls))]


def _storage_key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride())


ForwardContext = Union[StepContext, ProbeContext]

_CURRENT: contextvars.ContextVar[Optional[ForwardContext]] = contextvars.ContextVar("kvpage_forward", default=None)


@contextlib.contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Bind ``context`` as the running forward's for the duration of the ``with`` block."""
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)


def current_forward_context() -> Optional[ForwardContext]:
    """The bound forward's context; None outside a kvpage forward (a plain HF call)."""
    return _CURRENT.get()


def require_forward_context() -> ForwardContext:
    """The bound forward's context; raises if no kvpage forward is running."""
    context = _CURRENT.get()
    if context is None:
        raise RuntimeError("kvpage attention ran outside a kvpage forward (no forward context is bound)")
    return context
