"""The ``kvpage`` attention implementation for Hugging Face transformers.

Registered through ``transformers.AttentionInterface`` (no model class is patched).
During a paged forward the runner binds the step's ``PagedForwardContext`` with
``paged_step(context)`` for exactly the duration of that forward (a ``ContextVar``, so it
never leaks across threads or steps), and also passes it as ``kvpage_context=`` where the
model threads kwargs through. Each attention layer finds the context either way (layers
that drop ``**kwargs`` still work) and then

1. scatters the step's new K/V rows into the layer's paged buffers by ``slot_mapping``;
2. runs paged attention of the step's queries over each sequence's whole context.

Under ``torch.compile`` the two run as one registered custom op, ``kvpage::paged_attention``
(``paged_attention_op``), so the graph does not break at each layer.

Per-step keyword arguments passed to ``model(...)`` (one documented contract):
    input_ids, position_ids: ``[1, T]`` flattened ragged batch (``[n, L]`` for a model with
        recurrent layers: n sequences of equal query length, see ``hf_runner``).
    use_cache: False: the KV lives in kvpage's paged buffers, not an HF Cache. A model with
        recurrent layers gets True and a fresh ``DynamicCache`` holding only its recurrent
        states (``recurrent_state``); its attention layers find that cache empty.
    logits_to_keep: ``[S]`` tensor of rows whose logits are needed.
    kvpage_context: ``PagedForwardContext`` (below).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Protocol, Union

import torch

from kvpage.core.sched.metadata import StepMetadata
from kvpage.storage.kv_storage import LayerKVSpec

ATTN_IMPLEMENTATION = "kvpage"


class AttentionBackend(Protocol):
    """What the adapter needs from an attention backend; see ``attention_backends``."""

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


@dataclass
class PagedForwardContext:
    """Everything one forward step's attention layers need.

    KV buffers belong to attention *call sites*: one per layer, or more where a layer calls
    attention more than once per forward (differential attention calls it twice, with two
    halves of V), or a module shared by several layers (Zamba's shared attention block,
    whose ``layer_idx`` is None or -1: key -1). ``first_site[l]`` is layer ``l``'s first
    site; its ``n``-th call this forward uses site ``first_site[l] + n``. ``key_caches[s]`` / ``value_caches[s]`` are
    site ``s``'s paged buffers ``[num_blocks, block_size, heads, head_dim]`` (K and V may
    differ in heads and head size); a site that reuses another's KV holds its owner's
    buffers and is listed in ``reading_only``, so it attends without writing. ``prepared``
    is the backend's per-step view of the ``StepMetadata``; with hybrid KV groups,
    ``site_prepared[s]`` is the view of site ``s``'s group (its own block tables and slot
    mapping). ``layers_called`` counts the
    attention calls of this forward, so the runner can detect layers that bypass the
    interface.
    """

    key_caches: list
    value_caches: list
    backend: AttentionBackend
    prepared: Any
    layers_called: int = 0
    num_real_tokens: Optional[int] = None  # rows past it are compile-bucket padding
    reading_only: frozenset = frozenset()
    first_site: Optional[dict] = None  # None: one site per layer, site == layer
    site_prepared: Optional[list] = None  # None: every site reads ``prepared``
    site_chunks: Optional[list] = None  # each site's attention chunk (None: no chunked site)
    site_alibi: Optional[list] = None  # each site's ALiBi slopes (None: no ALiBi site)
    metadata: Optional[StepMetadata] = None  # the step's, for sites that read it whole (DSA indexers)
    mask_placeholder: bool = False  # hand the model ``MASK_PLACEHOLDER`` for its mask (DSA models index it)
    _calls: dict = field(default_factory=dict)  # layer -> calls so far this forward

    def _next_site(self, layer: int) -> int:
        """The site of layer ``layer``'s next call this forward (counted)."""
        self.layers_called += 1
        if self.first_site is None:
            return layer
        calls = self._calls.get(layer, 0)
        self._calls[layer] = calls + 1
        return self.first_site[layer] + calls

    def indexer_site(self, layer: int) -> tuple[torch.Tensor, StepMetadata]:
        """A DSA indexer's call (``sparse_indexer``): its site's key buffer (one head; the
        value buffer is empty) and the step's metadata; the indexer writes its own keys."""
        site = self._next_site(layer)
        if self.metadata is None or self.site_prepared is not None:
            raise RuntimeError("a DSA indexer needs the step's metadata and one KV group")
        return self.key_caches[site], self.metadata

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
               sliding_window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor],
               key_selection: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write the call site's new K/V (unless it reads another site's), then attend;
        tensors are ``[T, heads, D]``, the result ``[T, H, D_v]``. ``key_selection`` (DSA:
        ``[T, K]`` key positions per query, -1 none) restricts each query to those keys."""
        site = self._next_site(layer)
        key_cache, value_cache = self.key_caches[site], self.value_caches[site]
        prepared = self.prepared if self.site_prepared is None else self.site_prepared[site]
        if key_selection is not None:
            from kvpage.attention.torch_cpu import selected_attention_torch

            if site not in self.reading_only:
                self.backend.write_kv(key_cache, value_cache, k, v, prepared)
            md = self.metadata
            return selected_attention_torch(q, key_cache, value_cache, md.query_start_loc, md.seq_lens,
                                            md.block_tables, key_selection, scaling, softcap, sinks)
        chunk = self.site_chunks[site] if self.site_chunks is not None else None
        slopes = self.site_alibi[site] if self.site_alibi is not None else None
        if chunk or slopes is not None:  # only some backends mask by chunks or add ALiBi
            if site not in self.reading_only:
                self.backend.write_kv(key_cache, value_cache, k, v, prepared)
            extra = {"attention_chunk": chunk} if chunk else {}
            if slopes is not None:
                extra["alibi_slopes"] = slopes
            return self.backend.attention(q, key_cache, value_cache, prepared, scaling, sliding_window, softcap,
                                          sinks, **extra)
        fused = getattr(self.backend, "write_and_attend", None)
        if fused is not None:
            return fused(q, k, v, key_cache, value_cache, prepared, scaling, sliding_window, softcap, sinks,
                         write=site not in self.reading_only)
        if site not in self.reading_only:
            self.backend.write_kv(key_cache, value_cache, k, v, prepared)
        return self.backend.attention(q, key_cache, value_cache, prepared, scaling, sliding_window, softcap, sinks)


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
    mask_placeholder: bool = False  # as PagedForwardContext's
    _seen: dict = field(default_factory=dict)  # (k storage, v storage) -> first call handed them
    _alive: list = field(default_factory=list)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: Any = None,
               sliding_window: Optional[int] = None, *args: Any, attention_chunk: Optional[int] = None) -> torch.Tensor:
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

    def sites(self) -> list:
        """``[(layer, LayerKVSpec)]`` in site order (by layer, then call order), ``reuses``
        renumbered to site indices."""
        order = sorted(range(len(self.calls)), key=lambda i: (self.calls[i][0], i))
        site_of = {call: site for site, call in enumerate(order)}
        out = []
        for call in order:
            layer, spec = self.calls[call]
            if spec.reuses is not None:
                spec = dataclasses.replace(spec, reuses=site_of[spec.reuses])
            out.append((layer, spec))
        return out


def _storage_key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride())


def _layer_index(module: torch.nn.Module) -> int:
    """The layer an attention module belongs to; -1 for a module shared by several layers
    (no ``layer_idx``, or -1): its calls are told apart by their order (``first_site``)."""
    index = getattr(module, "layer_idx", None)
    return -1 if index is None else int(index)


def _attention_chunk(module: torch.nn.Module) -> Optional[int]:
    """The chunk size of a chunked-attention layer (transformers' ``layer_types`` entry
    "chunked_attention" with the config's ``attention_chunk_size``), else None."""
    config = getattr(module, "config", None)
    index = getattr(module, "layer_idx", None)
    try:
        kinds = getattr(config, "layer_types", None)
    except Exception:  # noqa: BLE001 - some configs refuse global reads of per-layer fields
        return None
    if not kinds or index is None or not 0 <= int(index) < len(kinds) or kinds[int(index)] != "chunked_attention":
        return None
    chunk = getattr(config, "attention_chunk_size", None)
    return int(chunk) if chunk else None


#: Keyword arguments by which a model hands attention an additive bias of its own making.
_BIAS_ARGUMENTS = ("position_bias", "attn_bias", "alibi", "attention_bias")


def kvpage_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    kvpage_context: Union[PagedForwardContext, ProbeContext, None] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over paged KV. ``query`` is ``[1, H, T, D]``, ``key``/``value`` ``[1, H_kv, T, D]``
    (or ``[n, ., L, .]``: n sequences of L rows each, T = n * L, from a model with recurrent
    layers); returns ``([1, T, H, D], None)`` (``[n, L, H, D]``) as transformers expects."""
    if attention_mask is MASK_PLACEHOLDER:
        attention_mask = None
    if torch.compiler.is_compiling():
        return _compiled_attention(module, query, key, value, scaling, sliding_window, softcap, s_aux)
    kvpage_context = kvpage_context or _STEP.get()
    if isinstance(kvpage_context, ProbeContext) and (attention_mask is not None or any(
            kwargs.get(name) is not None for name in _BIAS_ARGUMENTS)):
        kvpage_context.layers_with_masks.add(_layer_index(module))
    if kvpage_context is None:
        # A plain HF call (model.generate on a patched model): behave like stock attention.
        return _fallback_attention(module, query, key, value, attention_mask, scaling, dropout,
                                   sliding_window=sliding_window, softcap=softcap, s_aux=s_aux, **kwargs)
    batch, _, length, _ = query.shape
    if batch == 1:
        q = query[0].transpose(0, 1)  # [T, H, D]
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
    else:  # a recurrent model's forward of n sequences of one length: their rows, in order
        q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[3]) for t in (query, key, value))
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # The probe records which layers attend in chunks; a step reads that from its sites.
    extra = {"attention_chunk": _attention_chunk(module)} if isinstance(kvpage_context, ProbeContext) else {}
    if kwargs.get("indices") is not None and isinstance(kvpage_context, PagedForwardContext):
        extra["key_selection"] = kwargs["indices"].reshape(batch * length, -1)  # a DSA indexer's picks
    out = kvpage_context.attend(_layer_index(module), q, k, v, float(scaling), sliding_window, softcap, s_aux,
                                **extra)
    return out.reshape(batch, length, *out.shape[1:]), None


def _fallback_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """Stock transformers attention for calls without a kvpage context.

    SDPA where it applies; the model's own eager function for softcap or sinks, which
    SDPA cannot express.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"{type(module).__name__} needs eager attention for softcap/sinks and has none")
        return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    kwargs.pop("s_aux", None)
    kwargs.pop("softcap", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _compiled_attention(module, query, key, value, scaling, sliding_window, softcap, s_aux):
    """The traced form: the step's context is read inside the opaque op at run time."""
    from .paged_attention_op import paged_attention_op

    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = paged_attention_op(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                             _layer_index(module), float(scaling), int(sliding_window or 0), float(softcap or 0.0),
                             s_aux)
    return out.unsqueeze(0), None


# The context of the paged forward running now, if any. HF's mask builders are skipped
# while one is bound, since paged attention derives causality from positions.
_STEP: contextvars.ContextVar[Union[PagedForwardContext, ProbeContext, None]] = contextvars.ContextVar(
    "kvpage_step", default=None)


@contextlib.contextmanager
def paged_step(context: Union[PagedForwardContext, ProbeContext]) -> Iterator[None]:
    """Bind ``context`` as the current step's for the duration of one forward."""
    token = _STEP.set(context)
    try:
        yield
    finally:
        _STEP.reset(token)


def current_step() -> Union[PagedForwardContext, ProbeContext]:
    """The bound step context; raises if no paged forward is running."""
    context = _STEP.get()
    if context is None:
        raise RuntimeError("kvpage attention ran outside a paged step (no step context is bound)")
    return context


#: What the model gets for its attention mask in a paged step of a DSA model, whose
#: attention module indexes the mask before its indexer (which ignores it): kvpage builds
#: no mask, and attention treats this one as none.
MASK_PLACEHOLDER = torch.ones((1, 1, 1, 1), dtype=torch.bool)


def kvpage_mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """Mask builder for the ``kvpage`` implementation: none during paged steps (the
    placeholder where the step asks for one), else an eager mask."""
    if torch.compiler.is_compiling():
        return None
    step = _STEP.get()
    if step is not None:
        return MASK_PLACEHOLDER if step.mask_placeholder else None
    from transformers.masking_utils import eager_mask

    return eager_mask(*args, **kwargs)


def register_kvpage_attention() -> str:
    """Register the attention function and its mask builder with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpage_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvpage_mask)
    return ATTN_IMPLEMENTATION
