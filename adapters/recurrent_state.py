"""Recurrent state of state-space and linear-attention layers, in slots beside the paged KV.

transformers keeps the per-sequence state of Mamba-style mixers, gated delta nets,
short convolutions and other linear attention in its ``Cache`` (``LinearAttentionLayer``:
a convolution window and a recurrent state per layer, ``[batch, ...]`` each). kvpage
keeps those states per request instead: one slot tensor ``[num_slots, ...]`` per layer
and state, a request's slot number coming from the core's ``StateSlotPool``
(``StepMetadata.state_slots``). For each forward the runner builds a fresh
``DynamicCache`` whose stateful layers hold the batch's rows of the slots
(``cache_for``), lets the model update it as it always does, and writes the rows back
(``store``). Attention layers find that cache empty, so what they write to it is only
the step's own K/V; their history is read from the paged KV.

The layout is found by running the model once (``probe_state_layout``), so it follows
each family's own cache code and needs no per-family table. A model that keeps state
anywhere else (its own cache class, an internal buffer) shows no state here and stays
refused.

Contract of a state forward: every sequence of one forward has the same query length
and is either fresh (no state yet: the layers start from zeros, as HF's prefill does)
or resumes from its stored state; the runner groups a step's sequences that way.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

#: Forward keyword under which a model takes its cache (transformers renamed it).
_CACHE_ARGUMENTS = ("cache", "past_key_values")


@dataclass(frozen=True)
class StateEntry:
    """One state tensor of one layer: ``kind`` "conv" or "recurrent", the layer's state
    number ``index``, its per-sequence ``shape`` and ``dtype``; a convolution window's
    ``kernel_size``; ``marks_previous``: whether the layer's forward marks the state as
    present (``has_previous_state``), which a resumed cache must then say too."""

    layer: int
    kind: str
    index: int
    shape: tuple
    dtype: torch.dtype
    kernel_size: Optional[int]
    marks_previous: bool

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=self.dtype).element_size()


def cache_argument(model: torch.nn.Module) -> Optional[str]:
    """The name of ``model.forward``'s cache argument, or None if it takes none."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in _CACHE_ARGUMENTS if name in parameters), None)


def _new_cache(model: torch.nn.Module):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _linear_layers(cache) -> dict:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return {i: layer for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)}


def _states(layer, kind: str) -> dict:
    return layer.conv_states if kind == "conv" else layer.recurrent_states


def _initialized(layer, kind: str) -> dict:
    return layer.is_conv_states_initialized if kind == "conv" else layer.is_recurrent_states_initialized


def _forward(model: torch.nn.Module, argument: str, cache, ids: torch.Tensor, positions: torch.Tensor,
             **kwargs) -> torch.Tensor:
    out = model(input_ids=ids, position_ids=positions, use_cache=True, **{argument: cache}, **kwargs)
    return out.logits


def probe_state_layout(model: torch.nn.Module) -> list[StateEntry]:
    """The recurrent states ``model`` keeps in a transformers ``Cache``, from one HF forward
    of two tokens (the model's own attention; nothing kvpage binds). Empty when it keeps
    none there (an attention-only model, or state held elsewhere)."""
    argument = cache_argument(model)
    if argument is None:
        return []
    try:
        cache = _new_cache(model)
    except Exception:  # noqa: BLE001 - a config DynamicCache cannot read keeps no state we can slot
        return []
    if not _linear_layers(cache):
        return []
    device = next(model.parameters()).device
    ids = torch.tensor([[3, 4]], device=device)
    with torch.inference_mode():
        _forward(model, argument, cache, ids, torch.arange(2, device=device).unsqueeze(0))
    entries = []
    for index, layer in _linear_layers(cache).items():
        for kind in ("conv", "recurrent"):
            for state, tensor in _states(layer, kind).items():
                if tensor is None or not _initialized(layer, kind)[state]:
                    continue
                entries.append(StateEntry(index, kind, state, tuple(tensor.shape[1:]), tensor.dtype,
                                          layer.conv_kernel_size[state] if kind == "conv" else None,
                                          bool(layer.has_previous_state[state])))
    return entries


def chunked_prefill_is_exact(model: torch.nn.Module, num_tokens: int = 8) -> bool:
    """Whether the model continues a prompt from its stored state: the logits of a prompt
    fed in two chunks through one cache equal those of one forward (some mixers' prefill
    path starts from zeros and ignores a stored state; kvpage then prefills whole)."""
    argument = cache_argument(model)
    device = next(model.parameters()).device
    ids = (torch.arange(num_tokens, device=device) % 7 + 3).unsqueeze(0)
    positions = torch.arange(num_tokens, device=device).unsqueeze(0)
    half = num_tokens // 2
    with torch.inference_mode():
        whole = _forward(model, argument, _new_cache(model), ids, positions)[0, -1]
        cache = _new_cache(model)
        _forward(model, argument, cache, ids[:, :half], positions[:, :half])
        chunked = _forward(model, argument, cache, ids[:, half:], positions[:, half:])[0, -1]
    return bool(torch.allclose(whole.float(), chunked.float(), rtol=1e-3, atol=1e-4))


class RecurrentStateSlots:
    """The slot tensors of every ``StateEntry``: ``[num_slots, *entry.shape]`` each."""

    def __init__(self, model: torch.nn.Module, entries: list[StateEntry], num_slots: int,
                 device: torch.device) -> None:
        self.model = model
        self.entries = entries
        self.num_slots = num_slots
        self.buffers = [torch.zeros((num_slots, *e.shape), dtype=e.dtype, device=device) for e in entries]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def copy(self, pairs: np.ndarray) -> None:
        """Copy slot ``src`` into slot ``dst`` for each (src, dst) row, in order (forks)."""
        for src, dst in np.asarray(pairs).reshape(-1, 2).tolist():
            for buffer in self.buffers:
                buffer[dst].copy_(buffer[src])

    def cache_for(self, slots: torch.Tensor, resume: bool):
        """A fresh ``DynamicCache`` for one forward of the sequences in ``slots``: their
        stored rows (copies) when ``resume``, else nothing (the layers start from zeros)."""
        cache = _new_cache(self.model)
        if not resume:
            return cache
        layers = cache.layers
        for entry, buffer in zip(self.entries, self.buffers):
            layer = layers[entry.layer]
            _states(layer, entry.kind)[entry.index] = buffer.index_select(0, slots)
            _initialized(layer, entry.kind)[entry.index] = True
            if entry.kind == "conv":
                layer.conv_kernel_size[entry.index] = entry.kernel_size
            if entry.marks_previous:
                layer.has_previous_state[entry.index] = True
            layer.device, layer.dtype = buffer.device, buffer.dtype
        return cache

    def store(self, cache, slots: torch.Tensor) -> None:
        """Write the forward's final states back to the sequences' slots."""
        layers = cache.layers
        for entry, buffer in zip(self.entries, self.buffers):
            state = _states(layers[entry.layer], entry.kind)[entry.index]
            if state is None or tuple(state.shape[1:]) != entry.shape:
                raise RuntimeError(f"layer {entry.layer} left its {entry.kind} state {entry.index} "
                                   f"{'unset' if state is None else tuple(state.shape)}; expected "
                                   f"[{len(slots)}, {', '.join(map(str, entry.shape))}]")
            buffer.index_copy_(0, slots, state.to(buffer.dtype))
