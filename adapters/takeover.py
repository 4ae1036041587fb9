"""How kvpage takes a loaded model over: its attention switched to kvpage's, or ported.

``take_over(model, undo)`` makes every change kvpage needs in the model's attention and
pushes each one's undo onto ``undo`` (the runner's ``ExitStack``, closed by ``restore()``):

- a family whose attention bypasses transformers' interface gets its attention ports
  (``attention_ports``; which family uses which port is the registry's, ``families``);
- a DSA model gets its indexers ported (``sparse_indexer``): each becomes a paged site;
- every other model switches to the ``kvpage`` attention implementation, or, for a
  composite model whose text decoder alone follows the interface, its text config does.

The returned ``Takeover`` records what kvpage found and changed, and what follows from it
for the steps: the mask the model is handed, the ALiBi slopes kvpage adds, why it runs eager.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from .attention_ports import alibi_slopes_by_layer, install_ports
from .families import mask_alibi_slopes, needs_port, port_of
from .hf_attention import ATTN_IMPLEMENTATION, register_kvpage_attention
from .sparse_indexer import has_indexers, install_indexer_ports

#: Why a model's steps run eager whatever the settings: the first ``Takeover`` field that is
#: set names the reason.
_EAGER_REASONS = (
    ("recurrent", "a model with recurrent layers runs eager (several forwards per step, a cache object per forward)"),
    ("sparse_indexers", "a model with DeepSeek sparse attention runs eager (its indexers run per sequence)"),
    ("mask_alibi", "a model that folds ALiBi into its attention mask runs eager (the compiled graph builds no "
                   "mask to fold it into)"),
)


@dataclass(slots=True)
class Takeover:
    """What kvpage changed in a model's attention, and what its steps need because of it."""

    ported: bool  # attention ports replace the family's attention modules
    sparse_indexers: bool  # DSA indexers ported: each one more paged site of its layer
    recurrent: bool  # the model has recurrent layers (state slots, several forwards a step)
    mask_alibi: dict = field(default_factory=dict)  # {layer: slopes} of a family folding ALiBi into its mask

    @property
    def mask_placeholder(self) -> bool:
        """Whether the model is handed a placeholder for its attention mask: a DSA model's
        attention indexes the mask, a family folding ALiBi into it needs one to fold into."""
        return self.sparse_indexers or bool(self.mask_alibi)

    @property
    def eager_reason(self) -> Optional[str]:
        """Why this model's steps run eager whatever the settings, or None when they compile."""
        return next((why for name, why in _EAGER_REASONS if getattr(self, name)), None)

    def alibi_slopes(self, model: torch.nn.Module) -> dict:
        """``{layer: float32 slopes [heads]}`` that kvpage's attention adds (ALiBi ported or
        folded into the mask), ``{}`` for a model without ALiBi."""
        return alibi_slopes_by_layer(model) if self.ported else self.mask_alibi


def text_decoder_switchable(model: torch.nn.Module) -> bool:
    """Whether a composite model (text beside vision or audio towers) has a text decoder
    whose attention goes through the interface, though another tower's does not (GOT-OCR2's
    SAM vision encoder): kvpage then switches the text config alone. Text-only requests
    never run the other towers."""
    if "text_config" not in (getattr(model.config, "sub_configs", None) or {}):
        return False
    try:
        decoder = model.get_decoder()
    except Exception:  # noqa: BLE001 - models without a findable decoder are not switched this way
        return False
    return decoder is not None and decoder is not model and type(decoder)._can_set_attn_implementation()


def take_over(model: torch.nn.Module, undo: contextlib.ExitStack, recurrent: bool) -> Takeover:
    """Switch ``model``'s attention to kvpage's (see the module docstring), each change's
    undo pushed onto ``undo``."""
    register_kvpage_attention()
    switchable = type(model)._can_set_attn_implementation()
    ported = needs_port(model)
    if ported:
        undo.callback(install_ports(model, port_of(model)))
    sparse_indexers = has_indexers(model)
    if sparse_indexers:
        undo.callback(install_indexer_ports(model))
    config = model.config
    if not ported and not switchable and text_decoder_switchable(model):
        original = {"text_config": config.text_config._attn_implementation}
        model.set_attn_implementation({"text_config": ATTN_IMPLEMENTATION})
        undo.callback(model.set_attn_implementation, original)
    elif not ported and switchable:
        original = config._attn_implementation
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        undo.callback(model.set_attn_implementation, original)
    return Takeover(ported, sparse_indexers, recurrent, mask_alibi_slopes(model))
