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
each family's own cache code. Where the state travels is the family's *carrier*
(``state_carriers``): transformers' ``DynamicCache`` for most, MiniMax's own cache class,
RWKV's ``state`` list. A model that keeps state anywhere else (an internal buffer) shows
no state here and stays refused.

Contract of a state forward: every sequence of one forward has the same query length
and is either fresh (no state yet: the layers start from zeros, as HF's prefill does)
or resumes from its stored state; the runner groups a step's sequences that way.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .families import carrier_of
from .state_carriers import StateEntry

__all__ = ["RecurrentStateSlots", "StateEntry", "chunked_prefill_is_exact", "probe_state_layout", "state_argument"]


def state_argument(model: torch.nn.Module) -> str:
    """The forward keyword under which ``model`` takes its recurrent state."""
    return carrier_of(model).argument


def _forward(model: torch.nn.Module, carrier, state: Any, ids: torch.Tensor, positions: torch.Tensor,
             **kwargs) -> torch.Tensor:
    out = model(input_ids=ids, position_ids=positions, use_cache=True, **{carrier.argument: state}, **kwargs)
    return out.logits


def probe_state_layout(model: torch.nn.Module) -> list[StateEntry]:
    """The recurrent states ``model`` keeps in its carrier, from one HF forward of two
    tokens (the model's own attention; nothing kvpage binds). Empty when it keeps none
    there (an attention-only model, or state held elsewhere)."""
    carrier = carrier_of(model)
    if carrier.argument is None:
        return []
    device = next(model.parameters()).device
    try:
        state = carrier.new(1, device)
    except Exception:  # noqa: BLE001 - a config DynamicCache cannot read keeps no state we can slot
        return []
    if not carrier.has_state_layers(state):
        return []
    ids = torch.tensor([[3, 4]], device=device)
    with torch.inference_mode():
        _forward(model, carrier, state, ids, torch.arange(2, device=device).unsqueeze(0))
    return carrier.probe(state)


def chunked_prefill_is_exact(model: torch.nn.Module, num_tokens: int = 8) -> bool:
    """Whether the model continues a prompt from its stored state: the logits of a prompt
    fed in two chunks through one cache equal those of one forward (some mixers' prefill
    path starts from zeros and ignores a stored state; kvpage then prefills whole)."""
    carrier = carrier_of(model)
    device = next(model.parameters()).device
    ids = (torch.arange(num_tokens, device=device) % 7 + 3).unsqueeze(0)
    positions = torch.arange(num_tokens, device=device).unsqueeze(0)
    half = num_tokens // 2
    with torch.inference_mode():
        whole = _forward(model, carrier, carrier.new(1, device), ids, positions)[0, -1]
        state = carrier.new(1, device)
        _forward(model, carrier, state, ids[:, :half], positions[:, :half])
        chunked = _forward(model, carrier, state, ids[:, half:], positions[:, half:])[0, -1]
    return bool(torch.allclose(whole.float(), chunked.float(), rtol=1e-3, atol=1e-4))


class RecurrentStateSlots:
    """The slot tensors of every ``StateEntry``: ``[num_slots, *entry.shape]`` each."""

    def __init__(self, model: torch.nn.Module, entries: list[StateEntry], num_slots: int,
                 device: torch.device) -> None:
        self.carrier = carrier_of(model)
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
        """A fresh carrier for one forward of the sequences in ``slots``: their stored rows
        (copies) when ``resume``, else what the model starts a sequence from."""
        carrier = self.carrier.new(len(slots), slots.device)
        if resume:
            for entry, buffer in zip(self.entries, self.buffers):
                self.carrier.load(carrier, entry, buffer.index_select(0, slots))
        return carrier

    def store(self, carrier, slots: torch.Tensor) -> None:
        """Write the forward's final states back to the sequences' slots."""
        for entry, buffer in zip(self.entries, self.buffers):
            state = self.carrier.read(carrier, entry)
            if state is None or tuple(state.shape[1:]) != entry.shape:
                raise RuntimeError(f"layer {entry.layer} left its {entry.kind} state {entry.index} "
                                   f"{'unset' if state is None else tuple(state.shape)}; expected "
                                   f"[{len(slots)}, {', '.join(map(str, entry.shape))}]")
            buffer.index_copy_(0, slots, state.to(buffer.dtype))
