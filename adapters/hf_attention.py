"""The ``kvpage`` attention implementation for Hugging Face transformers.

Registered through ``transformers.AttentionInterface`` (no model class is patched), with a
mask builder of its own. During a kvpage forward each attention call finds the forward's
context (``forward_context``: bound by the runner for exactly that forward) and then

1. scatters the step's new K/V rows into its site's paged buffers by ``slot_mapping``;
2. runs paged attention of the step's queries over each sequence's whole context.

Under ``torch.compile`` the two run as one registered custom op, ``kvpage::paged_attention``
(``paged_attention_op``), so the graph does not break at each layer. Outside a kvpage
forward (a plain HF call on a switched model) the call is stock SDPA attention.

Per-step keyword arguments passed to ``model(...)`` (one documented contract):
    input_ids, position_ids: ``[1, T]`` flattened ragged batch (``[n, L]`` for a model with
        recurrent layers: n sequences of equal query length, see ``hf_runner``).
    use_cache: False: the KV lives in kvpage's paged buffers, not an HF Cache. A model with
        recurrent layers gets True and a fresh ``DynamicCache`` holding only its recurrent
        states (``recurrent_state``); its attention layers find that cache empty.
    logits_to_keep: ``[S]`` tensor of rows whose logits are needed.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from .forward_context import ProbeContext, current_forward_context
from .paged_attention_op import paged_attention_op

ATTN_IMPLEMENTATION = "kvpage"

#: What the model gets for its attention mask in a kvpage forward whose context asks for a
#: placeholder (``mask_placeholder``): a DSA model's attention module indexes the mask
#: before its indexer (which ignores it), and a family folding ALiBi into its mask needs one
#: to fold into. kvpage builds no mask, and its attention treats this one as none.
MASK_PLACEHOLDER = torch.ones((1, 1, 1, 1), dtype=torch.bool)

#: Keyword arguments by which a model hands attention an additive bias of its own making.
_BIAS_ARGUMENTS = ("position_bias", "attn_bias", "alibi", "attention_bias")


def _layer_index(module: torch.nn.Module) -> int:
    """The layer an attention module belongs to; -1 for a module shared by several layers
    (no ``layer_idx``, or -1): its calls are told apart by their order (``forward_context``)."""
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
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over paged KV. ``query`` is ``[1, H, T, D]``, ``key``/``value`` ``[1, H_kv, T, D]``
    (or ``[n, ., L, .]``: n sequences of L rows each, T = n * L, from a model with recurrent
    layers); returns ``([1, T, H, D], None)`` (``[n, L, H, D]``) as transformers expects.
    An ``indices`` keyword (``[n, L, K]`` key positions per query, -1 none: a DSA indexer's
    picks) restricts each query to those keys."""
    if attention_mask is MASK_PLACEHOLDER:
        attention_mask = None
    if torch.compiler.is_compiling():
        return _compiled_attention(module, query, key, value, scaling, sliding_window, softcap, s_aux)
    context = current_forward_context()
    if context is None:
        # A plain HF call (model.generate on a switched model): behave like stock attention.
        return _fallback_attention(module, query, key, value, attention_mask, scaling, dropout,
                                   sliding_window=sliding_window, softcap=softcap, s_aux=s_aux, **kwargs)
    batch, _, length, _ = query.shape
    if batch == 1:
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
    else:  # a recurrent model's forward of n sequences of one length: their rows, in order
        q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[3]) for t in (query, key, value))
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer = _layer_index(module)
    extra = {}
    if isinstance(context, ProbeContext):  # what a step reads from its sites, the probe finds out
        if attention_mask is not None or any(kwargs.get(name) is not None for name in _BIAS_ARGUMENTS):
            context.layers_with_masks.add(layer)
        extra["attention_chunk"] = _attention_chunk(module)
    if kwargs.get("indices") is not None:
        extra["key_selection"] = kwargs["indices"].reshape(batch * length, -1)
    out = context.attend(layer, q, k, v, float(scaling), sliding_window, softcap, s_aux, **extra)
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
    """The traced form: the forward's context is read inside the opaque op at run time."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = paged_attention_op(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                             _layer_index(module), float(scaling), int(sliding_window or 0), float(softcap or 0.0),
                             s_aux)
    return out.unsqueeze(0), None


def kvpage_mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """Mask builder for the ``kvpage`` implementation: none in a kvpage forward (the
    placeholder where its context asks for one), else an eager mask."""
    if torch.compiler.is_compiling():
        return None
    context = current_forward_context()
    if context is not None:
        return MASK_PLACEHOLDER if context.mask_placeholder else None
    from transformers.masking_utils import eager_mask

    return eager_mask(*args, **kwargs)


def register_kvpage_attention() -> str:
    """Register the attention function and its mask builder with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpage_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvpage_mask)
    return ATTN_IMPLEMENTATION
