"""Where a model's forward takes its recurrent state from and leaves it: a *carrier*.

``recurrent_state`` keeps each request's recurrent state in slot tensors and, for each
forward, hands the model a carrier holding the batch's rows, then reads the rows back. Most
families carry state in transformers' ``DynamicCache`` (its linear-attention layers' conv
and recurrent states); three keep it elsewhere:

- MiniMax's lightning attention: its own ``MiniMaxCache`` (which its forward insists on),
  one ``[batch, heads, head_dim, head_dim]`` tensor per linear layer in ``linear_cache``.
- RWKV: the ``state`` list its forward takes and returns, five ``[batch, hidden, layers]``
  tensors (the token-shift inputs of attention and feed-forward, then the WKV numerator,
  denominator and running maximum).
- RecurrentGemma: attributes of its recurrent blocks (``conv1d_state``, the RG-LRU's
  ``recurrent_states``), which its forward reads and replaces whenever it is handed a
  cache; the carrier sets them before the forward and reads them after (one forward runs
  at a time, and the runner owns the model meanwhile).

Which family keeps its state where is the family registry's (``families.carrier_of``).
A carrier knows the forward keyword it goes under (``argument``), how to make a fresh one
for a batch (what the model's own first forward would start from), and how to put one
state's rows in (``load``) and read them out (``read``); ``probe`` lists the states, found
by running the model once where the family's layout is not fixed by its config;
``batch_limit`` caps how many sequences one forward of a query length may hold.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

#: Forward keyword under which a model takes its transformers cache (transformers renamed it).
_CACHE_ARGUMENTS = ("cache", "past_key_values")


@dataclass(frozen=True)
class StateEntry:
    """One state tensor of one layer: ``kind`` ("conv" or "recurrent" in a transformers
    cache layer, "linear_cache" for MiniMax, "rwkv" for RWKV, "rg_lru" for RecurrentGemma),
    the layer's state number ``index``, its per-sequence ``shape`` and ``dtype``; a
    convolution window's ``kernel_size``; ``marks_previous``: whether the layer's forward
    marks the state as present (``has_previous_state``), which a resumed cache must then
    say too."""

    layer: int
    kind: str
    index: int
    shape: tuple
    dtype: torch.dtype
    kernel_size: Optional[int] = None
    marks_previous: bool = False

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=self.dtype).element_size()


def cache_argument(model: torch.nn.Module) -> Optional[str]:
    """The name of ``model.forward``'s transformers-cache argument, or None if it takes none."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in _CACHE_ARGUMENTS if name in parameters), None)


class StateCarrier:
    """The contract every carrier keeps (the defaults here suit most)."""

    argument: Optional[str] = "cache"  # the forward keyword the carrier goes under

    def new(self, batch: int, device: torch.device) -> Any:
        """A fresh carrier for ``batch`` sequences: what the model starts a sequence from."""
        raise NotImplementedError

    def has_state_layers(self, carrier: Any) -> bool:
        """Whether a fresh carrier has anywhere to keep state (probing is pointless otherwise)."""
        return True

    def probe(self, carrier: Any) -> list[StateEntry]:
        """The states a forward of one sequence left in ``carrier``."""
        raise NotImplementedError

    def load(self, carrier: Any, entry: StateEntry, rows: torch.Tensor) -> None:
        """Put the batch's rows of one state into ``carrier``."""
        raise NotImplementedError

    def read(self, carrier: Any, entry: StateEntry) -> Optional[torch.Tensor]:
        """The batch's rows of one state after a forward (None if the forward left none)."""
        raise NotImplementedError

    def batch_limit(self, query_len: int) -> Optional[int]:
        """At most this many sequences per forward of ``query_len`` tokens (None: any)."""
        return None


class CacheCarrier(StateCarrier):
    """State in transformers' ``DynamicCache``: its ``LinearAttentionCacheLayerMixin`` layers."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.argument = cache_argument(model)

    def new(self, batch: int, device: torch.device) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def probe(self, carrier: Any) -> list[StateEntry]:
        entries = []
        for index, layer in _linear_layers(carrier).items():
            for kind in ("conv", "recurrent"):
                for state, tensor in _states(layer, kind).items():
                    if tensor is None or not _initialized(layer, kind)[state]:
                        continue
                    entries.append(StateEntry(index, kind, state, tuple(tensor.shape[1:]), tensor.dtype,
                                              layer.conv_kernel_size[state] if kind == "conv" else None,
                                              bool(layer.has_previous_state[state])))
        return entries

    def has_state_layers(self, carrier: Any) -> bool:
        return bool(_linear_layers(carrier))

    def load(self, carrier: Any, entry: StateEntry, rows: torch.Tensor) -> None:
        layer = carrier.layers[entry.layer]
        _states(layer, entry.kind)[entry.index] = rows
        _initialized(layer, entry.kind)[entry.index] = True
        if entry.kind == "conv":
            layer.conv_kernel_size[entry.index] = entry.kernel_size
        if entry.marks_previous:
            layer.has_previous_state[entry.index] = True
        layer.device, layer.dtype = rows.device, rows.dtype

    def read(self, carrier: Any, entry: StateEntry) -> Optional[torch.Tensor]:
        return _states(carrier.layers[entry.layer], entry.kind)[entry.index]


class MiniMaxCarrier(StateCarrier):
    """MiniMax's ``MiniMaxCache``: a ``DynamicCache`` (its attention layers) plus
    ``linear_cache``, one K^T V state per lightning-attention layer."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.cache_class = _modeling_module(model).MiniMaxCache

    def new(self, batch: int, device: torch.device) -> Any:
        return self.cache_class()

    def probe(self, carrier: Any) -> list[StateEntry]:
        return [StateEntry(layer, "linear_cache", 0, tuple(state.shape[1:]), state.dtype)
                for layer, state in enumerate(carrier.linear_cache) if isinstance(state, torch.Tensor)]

    def load(self, carrier: Any, entry: StateEntry, rows: torch.Tensor) -> None:
        carrier.set_linear_cache(entry.layer, rows)

    def read(self, carrier: Any, entry: StateEntry) -> Optional[torch.Tensor]:
        state = carrier.get_linear_cache(entry.layer)
        return state if isinstance(state, torch.Tensor) else None


class RwkvCarrier(StateCarrier):
    """RWKV's ``state`` list: five ``[batch, hidden, layers]`` tensors; a fresh one is what
    ``RwkvModel`` starts from (zeros; the running maximum at -1e30; the two token-shift
    inputs in the model's dtype, the WKV sums in float32)."""

    argument = "state"

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        self.hidden, self.layers = int(config.hidden_size), int(config.num_hidden_layers)
        self.dtype = model.get_input_embeddings().weight.dtype

    def batch_limit(self, query_len: int) -> Optional[int]:
        # RWKV's one-token path mixes a [batch, hidden] shift state into [batch, 1, hidden]
        # inputs, which broadcasts across the batch when it holds more than one sequence
        # (HF's own batched decoding is affected): one sequence per one-token forward.
        return 1 if query_len == 1 else None

    def _dtype(self, index: int) -> torch.dtype:
        return self.dtype if index <= 1 else torch.float32

    def new(self, batch: int, device: torch.device) -> Any:
        state = [torch.zeros((batch, self.hidden, self.layers), dtype=self._dtype(i), device=device)
                 for i in range(5)]
        state[4] -= 1e30
        return state

    def probe(self, carrier: Any) -> list[StateEntry]:
        return [StateEntry(layer, "rwkv", i, (self.hidden,), self._dtype(i))
                for layer in range(self.layers) for i in range(5)]

    def load(self, carrier: Any, entry: StateEntry, rows: torch.Tensor) -> None:
        carrier[entry.index][:, :, entry.layer] = rows

    def read(self, carrier: Any, entry: StateEntry) -> Optional[torch.Tensor]:
        return carrier[entry.index][:, :, entry.layer]


class RecurrentGemmaCarrier(StateCarrier):
    """RecurrentGemma's recurrent blocks keep their state on themselves: the convolution
    window ``conv1d_state`` ``[batch, hidden, width - 1]`` (the model's dtype) and the RG-LRU's
    ``recurrent_states`` ``[batch, lru_width]`` (float32). The forward gets a fresh
    ``DynamicCache`` (for its attention layers, and so that it does not reset the blocks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.config = model.config
        self.dtype = model.get_input_embeddings().weight.dtype
        self.blocks = {index: layer.temporal_block for index, layer in enumerate(model.model.layers)
                       if hasattr(layer.temporal_block, "rg_lru")}

    def new(self, batch: int, device: torch.device) -> Any:
        from transformers import DynamicCache

        for block in self.blocks.values():  # what the model's own _setup_cache starts from
            block.conv1d_state = torch.zeros((batch, block.hidden_size, block.conv1d_width - 1), dtype=self.dtype,
                                             device=device)
            block.rg_lru.recurrent_states = torch.zeros((batch, block.lru_width), dtype=torch.float32, device=device)
        return DynamicCache(config=self.config)

    def has_state_layers(self, carrier: Any) -> bool:
        return bool(self.blocks)

    def probe(self, carrier: Any) -> list[StateEntry]:
        entries = []
        for layer, block in self.blocks.items():
            for index, state in enumerate((block.conv1d_state, block.rg_lru.recurrent_states)):
                entries.append(StateEntry(layer, "rg_lru", index, tuple(state.shape[1:]), state.dtype))
        return entries

    def load(self, carrier: Any, entry: StateEntry, rows: torch.Tensor) -> None:
        block = self.blocks[entry.layer]
        if entry.index == 0:
            block.conv1d_state = rows
        else:
            block.rg_lru.recurrent_states = rows

    def read(self, carrier: Any, entry: StateEntry) -> Optional[torch.Tensor]:
        block = self.blocks[entry.layer]
        return block.conv1d_state if entry.index == 0 else block.rg_lru.recurrent_states


def _modeling_module(model: torch.nn.Module):
    return sys.modules[type(model).__module__]


def _linear_layers(cache) -> dict:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return {i: layer for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)}


def _states(layer, kind: str) -> dict:
    return layer.conv_states if kind == "conv" else layer.recurrent_states


def _initialized(layer, kind: str) -> dict:
    return layer.is_conv_states_initialized if kind == "conv" else layer.is_recurrent_states_initialized
