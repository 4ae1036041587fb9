"""Runs one scheduled step through a Hugging Face model with paged KV.

Implements ``kvpage.interfaces.ModelRunner``: ``execute(metadata)`` takes a
``StepMetadata`` and returns float32 logits ``[S, vocab]`` for ``metadata.logits_indices``
(in that order). The model sees one
flattened ragged batch ``[1, T]``; attention reads and writes the paged buffers.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from kvpage.core.metadata import StepMetadata
from kvpage.kv_storage import PagedKVCache

from .hf_attention import (ATTN_IMPLEMENTATION, AttentionBackend, LayerKVShape, PagedForwardContext, ProbeContext,
                           paged_step, register_kvpage_attention)


class UnsupportedModelError(ValueError):
    """The model cannot run on kvpage (its attention bypasses the attention interface, ...)."""


def check_supported(model: torch.nn.Module) -> None:
    """Raise ``UnsupportedModelError`` naming the reason when ``model`` cannot be paged."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise UnsupportedModelError(f"{name} is not a transformers PreTrainedModel")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; kvpage serves decoder-only models")
    if not type(model)._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{name}'s attention does not go through transformers' AttentionInterface, so kvpage cannot page its KV"
        )


class HFModelRunner:
    """Owns the model's switch to kvpage attention and one forward per step."""

    def __init__(self, model: torch.nn.Module) -> None:
        check_supported(model)
        self.model = model
        self.device = next(model.parameters()).device
        self.original_attn_implementation = model.config._attn_implementation
        register_kvpage_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.num_layers = int(model.config.num_hidden_layers)
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.kv_cache: Optional[PagedKVCache] = None
        self.key_caches: list = []
        self.value_caches: list = []
        self.backend: Optional[AttentionBackend] = None
        self.layer_shapes, self.kv_dtype = self._probe_layers()

    def _probe_layers(self) -> tuple[list[LayerKVShape], torch.dtype]:
        probe = self.probe_forward(1)
        if len(probe.shapes) != self.num_layers or probe.layers_called != self.num_layers:
            self.restore()
            raise UnsupportedModelError(
                f"{type(self.model).__name__}: only {probe.layers_called} of {self.num_layers} layers called the "
                "kvpage attention; the others bypass transformers' attention interface (or have no attention)"
            )
        return [probe.shapes[i] for i in range(self.num_layers)], probe.dtype

    def probe_forward(self, num_tokens: int) -> ProbeContext:
        """A forward of ``num_tokens`` dummy tokens with attention stubbed out (shapes, memory)."""
        probe = ProbeContext()
        ids = torch.zeros((1, num_tokens), dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device).unsqueeze(0)
        with torch.inference_mode(), paged_step():
            self.model(input_ids=ids, position_ids=positions, use_cache=False, kvpage_context=probe,
                       **({"logits_to_keep": 1} if self._takes_logits_to_keep else {}))
        return probe

    def bind(self, kv_cache: PagedKVCache, backend: AttentionBackend) -> None:
        """Attach the paged KV buffers (a ``PagedKVCache``) and the attention backend."""
        if kv_cache.spec.num_layers != self.num_layers:
            raise ValueError(f"expected a KV cache of {self.num_layers} layers, got {kv_cache.spec.num_layers}")
        self.kv_cache = kv_cache
        self.key_caches = [kv_cache.torch_key_cache(i) for i in range(self.num_layers)]
        self.value_caches = [kv_cache.torch_value_cache(i) for i in range(self.num_layers)]
        self.backend = backend

    @torch.inference_mode()
    def execute(self, metadata: StepMetadata) -> torch.Tensor:
        if len(metadata.block_copies):
            self.kv_cache.copy_blocks(metadata.block_copies)  # copy-on-write, before any KV write
        device = self.device
        input_ids = torch.as_tensor(metadata.input_ids, device=device).unsqueeze(0)
        positions = torch.as_tensor(metadata.positions, device=device).unsqueeze(0)
        rows = torch.as_tensor(metadata.logits_indices, dtype=torch.long, device=device)
        context = PagedForwardContext(self.key_caches, self.value_caches, self.backend, self.backend.prepare(metadata))
        kwargs = dict(input_ids=input_ids, position_ids=positions, use_cache=False, kvpage_context=context)
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = rows
        with paged_step():
            logits = self.model(**kwargs).logits[0]
        if not self._takes_logits_to_keep:
            logits = logits[rows]
        if context.layers_called != self.num_layers:
            raise RuntimeError(f"{self.num_layers - context.layers_called} layers bypassed kvpage attention")
        return logits.float()

    def restore(self) -> None:
        """Switch the model back to the attention implementation it had before."""
        self.model.set_attn_implementation(self.original_attn_implementation)
