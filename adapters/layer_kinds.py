"""Which layers of a Hugging Face model kvpage can serve: attention over a KV cache, nothing else.

kvpage pages attention K/V. A layer that carries recurrent state from token to token
(Mamba and other state-space mixers, gated delta nets, linear attention, short
convolutions, RWKV, xLSTM, RG-LRU) is served when the model's forward carries that state
in and out (transformers' ``Cache``, or a family carrier: ``state_carriers``), which
``recurrent_state`` slots per request; this module names the recurrent layers so that
the runner can look. A layer that picks its keys through an
indexer (DeepSeek's sparse attention, ``indexed_attention``) is served where the indexer
is a module kvpage can port (``sparse_indexer`` pages its keys); compressed variants
(DeepSeek-V4's) keep state kvpage does not, so such a model is refused, with the layer
named, before anything runs.

Two sources, both read-only: the text config's ``layer_types`` (transformers names the
kinds: "full_attention", "sliding_attention", "linear_attention", "conv", ...), and the
classes of the model's modules (for models whose config names no layer kinds).
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from .sparse_indexer import has_indexers

#: Layer kinds that keep recurrent state (transformers' ``layer_types`` names).
RECURRENT_KINDS = frozenset({"linear_attention", "conv", "mamba", "mamba2", "recurrent", "ssm", "rwkv", "mlstm",
                             "slstm", "gated_deltanet", "deltanet", "lightning_attention",
                             "hybrid", "hybrid_sliding"})  # attention beside a state-space or convolutional mixer
#: Layer kinds that attend to a learned subset of keys, selected with a cache of their own.
SPARSE_KINDS = frozenset({"indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention"})
# Module classes that hold recurrent state -> the layer type they implement ("...Mixer" is
# transformers' name for the Mamba-style state-space mixers: BambaMixer, FalconH1Mixer, ...).
_STATE_CLASSES = {"Mamba": "mamba", "Mixer$": "mamba", "GatedDeltaNet": "gated_deltanet", "DeltaNet": "deltanet",
                  "DeltaAttention": "delta_attention", "ShortConv": "short_conv", "LinearAttention": "linear_attention",
                  "Lightning": "lightning_attention", "Rwkv": "rwkv", "xLSTM": "xlstm", "mLSTM": "xlstm",
                  "sLSTM": "xlstm", "RecurrentBlock": "rg_lru", "Rglru": "rg_lru", "RGLRU": "rg_lru"}
_STATE_CLASS = re.compile("|".join(_STATE_CLASSES))


def _state_class_type(class_name: str) -> str:
    for pattern, layer_type in _STATE_CLASSES.items():
        if re.search(pattern, class_name):
            return layer_type
    return class_name


_WHOLE_MODEL = re.compile(r"(Model|ForCausalLM|LMHeadModel|ForConditionalGeneration)$")


def unsupported_layer_reason(model: torch.nn.Module, state_in_cache: bool = False) -> Optional[str]:
    """Why kvpage cannot serve ``model``'s layers, or None when every layer is plain attention
    (or, with ``state_in_cache``, attention or recurrent layers whose state lives in
    transformers' ``Cache``, which kvpage keeps in state slots: ``recurrent_state``)."""
    for index, kind in enumerate(_layer_kinds(model)):
        if kind in RECURRENT_KINDS:
            if state_in_cache:
                continue
            return _recurrent_reason(model, index, kind)
        if kind in SPARSE_KINDS and not (kind == "indexed_attention" and has_indexers(model)):
            return (f"kvpage serves dense attention over its KV blocks only; layer type '{kind}' (layer {index}) "
                    "attends to keys chosen by an indexer that keeps a cache of its own")
    if not state_in_cache and _state_module(model, None) is not None:
        return _recurrent_reason(model, None, None)
    return None


def _recurrent_reason(model: torch.nn.Module, index: Optional[int], kind: Optional[str]) -> str:
    """The reason, naming the layer type by the module that implements it when one is found."""
    found = _state_module(model, index) or _state_module(model, None)
    layer_type = _state_class_type(found) if found else kind
    detail = [found] if found else []
    if index is not None:
        detail.append(f"layer {index}")
    if kind is not None and kind != layer_type:
        detail.append(f"layer_types says '{kind}'")
    return (f"layer type '{layer_type}' keeps recurrent state"
            + (f" ({', '.join(detail)})" if detail else "")
            + " outside transformers' Cache; kvpage keeps recurrent state only where the model's forward "
              "carries it in and out (the Cache's conv and recurrent states, MiniMax's cache, RWKV's state list)")


def attention_modules(model: torch.nn.Module) -> list[str]:
    """Class names of all of ``model``'s attention modules (recurrent mixers named like
    attention left out); empty for a model of recurrent layers alone (RWKV)."""
    return [type(m).__name__ for m in model.modules()
            if "Attention" in type(m).__name__ and not _STATE_CLASS.search(type(m).__name__)]


def attention_modules_of_layer(model: torch.nn.Module, layer: int) -> list[str]:
    """Class names of layer ``layer``'s attention modules (recurrent mixers named like
    attention, e.g. gated delta nets or linear attention, left out)."""
    names = []
    for path, module in model.named_modules():
        name = type(module).__name__
        if f"layers.{layer}." in f"{path}." and "Attention" in name and not _STATE_CLASS.search(name):
            names.append(name)
    return names


def _layer_kinds(model: torch.nn.Module) -> list[str]:
    config = getattr(model, "config", None)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:  # some configs compute layer_types, and a few refuse to read per-layer attributes globally
        kinds = getattr(text, "layer_types", None)
    except Exception:  # noqa: BLE001
        kinds = None
    return [str(kind) for kind in kinds] if isinstance(kinds, (list, tuple)) else []


def _state_module(model: torch.nn.Module, layer: Optional[int]) -> Optional[str]:
    """The class name of the first module holding recurrent state (in layer ``layer`` if given)."""
    for path, module in model.named_modules():
        name = type(module).__name__
        if _WHOLE_MODEL.search(name) or not _STATE_CLASS.search(name):
            continue
        if layer is None or f"layers.{layer}." in f"{path}.":
            return name
    return None
