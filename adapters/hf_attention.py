"""The ``kvpage`` attention implementation for Hugging Face transformers.

Registered through ``transformers.AttentionInterface`` (no model class is patched).
A model switched to it with ``set_attn_implementation("kvpage")`` expects every forward
call to carry ``kvpage_context=<PagedForwardContext>`` in its kwargs; transformers hands
those kwargs to each attention layer, which then

1. scatters the step's new K/V rows into the layer's paged buffers by ``slot_mapping``;
2. runs paged attention of the step's queries over each sequence's whole context.

Per-step keyword arguments passed to ``model(...)`` (one documented contract):
    input_ids, position_ids: ``[1, T]`` flattened ragged batch.
    use_cache: always False: the KV lives in kvpage's paged buffers, not an HF Cache.
    logits_to_keep: ``[S]`` tensor of rows whose logits are needed.
    kvpage_context: ``PagedForwardContext`` (below).
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Protocol

import torch

ATTN_IMPLEMENTATION = "kvpage"


class AttentionBackend(Protocol):
    """What the adapter needs from an attention backend (see ``kvpage.attention``)."""

    def prepare(self, metadata: Any) -> Any:
        """Turn a ``StepMetadata`` into whatever the backend reads per layer (built once per step)."""

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 prepared: Any) -> None: ...

    def attention(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, prepared: Any,
                  scaling: float, sliding_window: Optional[int], softcap: Optional[float],
                  sinks: Optional[torch.Tensor]) -> torch.Tensor: ...


@dataclass
class PagedForwardContext:
    """Everything one forward step's attention layers need.

    ``key_caches[l]`` / ``value_caches[l]`` are layer ``l``'s paged buffers
    ``[num_blocks, block_size, num_kv_heads, head_dim]``. ``layers_called`` counts the
    attention calls of this forward so the runner can detect layers that bypass the interface.
    """

    key_caches: list
    value_caches: list
    backend: AttentionBackend
    prepared: Any
    layers_called: int = 0
    layer_index_of: dict = field(default_factory=dict)


def _layer_index(module: torch.nn.Module, context: PagedForwardContext) -> int:
    index = getattr(module, "layer_idx", None)
    if index is None:
        index = context.layer_index_of.get(id(module))
    if index is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx; kvpage cannot tell which KV buffer it owns")
    return int(index)


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
    kvpage_context: Optional[PagedForwardContext] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over paged KV. ``query`` is ``[1, H, T, D]``, ``key``/``value`` ``[1, H_kv, T, D]``;
    returns ``([1, T, H, D], None)`` as transformers expects."""
    if kvpage_context is None:
        # A plain HF call (model.generate on a patched model): behave like stock attention.
        return _fallback_attention(module, query, key, value, attention_mask, scaling, dropout,
                                   sliding_window=sliding_window, softcap=softcap, s_aux=s_aux, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"kvpage feeds one flattened ragged batch; got batch dimension {query.shape[0]}")
    context = kvpage_context
    layer = _layer_index(module, context)
    context.layers_called += 1
    key_cache, value_cache = context.key_caches[layer], context.value_caches[layer]
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    context.backend.write_kv(key_cache, value_cache, k, v, context.prepared)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = context.backend.attention(q, key_cache, value_cache, context.prepared, float(scaling),
                                    sliding_window, softcap, s_aux)
    return out.unsqueeze(0), None


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


# True while a kvpage engine runs a paged forward: HF's mask builders are then skipped,
# since paged attention derives causality from positions and would ignore the mask.
_PAGED_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("kvpage_paged_step", default=False)


@contextlib.contextmanager
def paged_step() -> Iterator[None]:
    token = _PAGED_STEP.set(True)
    try:
        yield
    finally:
        _PAGED_STEP.reset(token)


def kvpage_mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """Mask builder for the ``kvpage`` implementation: none during paged steps, else an eager mask."""
    if _PAGED_STEP.get():
        return None
    from transformers.masking_utils import eager_mask

    return eager_mask(*args, **kwargs)


def register_kvpage_attention() -> str:
    """Register the attention function and its mask builder with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpage_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvpage_mask)
    return ATTN_IMPLEMENTATION
