"""A model's per-layer KV spec read from its Hugging Face config alone (no weights, no forward).

For planning (``kvpage plan``): the engine itself probes the loaded model
(``HFModelRunner``), and a test checks the two agree on the model matrix. Read here:
layer count, KV heads and head size (MLA's split K/V heads included), and each layer's
attention kind from ``layer_types`` (``"sliding_attention"`` takes ``sliding_window``;
recurrent kinds such as ``"linear_attention"`` or ``"mamba"`` hold state, not KV, and
get no KV layer).
"""
from __future__ import annotations

from typing import Any

from kvpage.storage.spec import KVCacheSpec, LayerKVSpec

from .layer_kinds import RECURRENT_KINDS

_SLIDING = "sliding_attention"
_FULL = "full_attention"
# Kinds planned as another: a hybrid layer runs attention beside its mixer; a chunked layer
# (Llama 4) keeps its whole context, as full attention does.
_PLANNED_AS = {"hybrid": _FULL, "hybrid_sliding": _SLIDING, "chunked_attention": _FULL}


def max_positions(config: Any) -> int:
    """The positions a model's (text) config declares, under any of HF's names; 2048 when
    it declares none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def layer_windows(config: Any) -> list:
    """Each attention layer's sliding window (``None``: full attention), as the HF modules
    read them; recurrent layers are left out."""
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        if len(layer_types) != num_layers:
            raise ValueError(f"config has {len(layer_types)} layer_types for {num_layers} layers")
        # Other recurrent kinds hold state only, no KV.
        layer_types = [_PLANNED_AS.get(t, t) for t in layer_types if t in _PLANNED_AS or t not in RECURRENT_KINDS]
        unknown = sorted({t for t in layer_types if t not in (_SLIDING, _FULL)})
        if unknown:
            raise ValueError(f"kvpage plans full and sliding-window attention only; config has {unknown}")
        return [int(window) if t == _SLIDING and window else None for t in layer_types]
    if window and getattr(config, "use_sliding_window", True):
        return [int(window)] * num_layers
    return [None] * num_layers


def layer_kv(config: Any) -> LayerKVSpec:
    """The KV layout of one layer: MLA (``kv_lora_rank``) or K and V of one shape."""
    heads = int(config.num_attention_heads)
    if getattr(config, "kv_lora_rank", None):
        k_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        return LayerKVSpec(heads, k_dim, heads, int(config.v_head_dim))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return LayerKVSpec.symmetric(kv_heads, int(head_dim))


def kv_spec_from_config(config: Any, block_size: int, dtype: str) -> KVCacheSpec:
    """The ``KVCacheSpec`` of ``config`` (a transformers config; its text part is used)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "num_kv_shared_layers", 0):
        raise ValueError("models that share KV across layers are planned from a probe only; load the model")
    try:
        windows = layer_windows(config)
        if not windows:  # recurrent layers only (Mamba): no KV
            return KVCacheSpec((), block_size, dtype)
        layout = layer_kv(config)
    except Exception as exc:  # noqa: BLE001 - per-layer configs raise their own types (RuntimeError, ...)
        raise ValueError(f"cannot read one KV layout from this config ({type(exc).__name__}: {exc}); "
                         "per-layer shapes are read from a probe of the loaded model only") from None
    layers = tuple(LayerKVSpec(layout.k_heads, layout.k_head_dim, layout.v_heads, layout.v_head_dim,
                               sliding_window=window) for window in windows)
    return KVCacheSpec(layers, block_size, dtype)
