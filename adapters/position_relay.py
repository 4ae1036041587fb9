"""Hands the step's ``position_ids`` to positional embeddings that number tokens themselves.

Bart-style decoders (Bart, MBart, PLBart, Marian, Pegasus, BigBird-Pegasus, Blenderbot,
Blenderbot-Small) accept ``position_ids`` in ``forward(**kwargs)`` but drop it: the decoder
numbers its tokens ``cache_length + arange(T)`` and passes that to its ``embed_positions``
module as the ``position_ids`` keyword. kvpage's flattened step holds sequences at
different positions with no HF cache, so every token would be embedded at its index in the
step. Their ``embed_positions`` modules all take the keyword, so two forward pre-hooks
(PyTorch's public module-hook API, not a patch of transformers' code) fix it: one on the
top-level model keeps the ``position_ids`` the caller passed, one on each positional
embedding swaps them in for the decoder's own numbering. The embedding's arithmetic
(learned table and offset, or sinusoids) is the model's own, so the result is what HF
computes for a lone sequence. The hooks are traced by ``torch.compile`` like the rest of
the forward.
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch


class _StepPositions:
    """The ``position_ids`` ([1, T]) of the forward in progress; None outside one."""

    def __init__(self) -> None:
        self.position_ids: Optional[torch.Tensor] = None


def positional_embeddings(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's ``embed_positions`` modules whose forward takes ``position_ids``."""
    found = []
    for module in model.modules():
        embed = getattr(module, "embed_positions", None)
        if isinstance(embed, torch.nn.Module) and "position_ids" in inspect.signature(embed.forward).parameters:
            found.append(embed)
    return found


def relay_position_ids(model: torch.nn.Module) -> Optional[Callable[[], None]]:
    """Make ``model``'s positional embeddings use the ``position_ids`` the model is called
    with. Returns a function that removes the hooks, or None (nothing registered) when the
    model has no such embedding."""
    embeds = positional_embeddings(model)
    if not embeds:
        return None
    step = _StepPositions()

    def keep(_module, args, kwargs):
        step.position_ids = kwargs.get("position_ids")
        return None

    def forget(_module, _args, _kwargs, _output):
        step.position_ids = None
        return None

    def swap_in(_module, args, kwargs):
        if step.position_ids is None:
            return None
        # The decoders pass a flat [T] numbering; every embedding broadcasts it over the batch.
        return args, {**kwargs, "position_ids": step.position_ids.reshape(-1)}

    handles = [model.register_forward_pre_hook(keep, with_kwargs=True),
               model.register_forward_hook(forget, with_kwargs=True, always_call=True)]
    handles += [embed.register_forward_pre_hook(swap_in, with_kwargs=True) for embed in embeds]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove
