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
from kvpage.kv_storage import LayerKVSpec, PagedKVCache

from .compiled_forward import CompiledForward
from .onednn_linear import use_onednn_linears
from .hf_attention import (ATTN_IMPLEMENTATION, AttentionBackend, PagedForwardContext, ProbeContext, paged_step,
                           register_kvpage_attention)


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

    def __init__(self, model: torch.nn.Module, onednn_linears: bool = False) -> None:
        check_supported(model)
        self.model = model
        self.device = next(model.parameters()).device
        self.original_attn_implementation = model.config._attn_implementation
        register_kvpage_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self._undo_linears = use_onednn_linears(model) if onednn_linears else (lambda: None)
        self.num_layers = int(model.config.num_hidden_layers)
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.kv_cache: Optional[PagedKVCache] = None
        self.key_caches: list = []
        self.value_caches: list = []
        self.backend: Optional[AttentionBackend] = None
        self.compiled: Optional[CompiledForward] = None  # set by compile()
        self.reading_only: frozenset = frozenset()
        self.layer_specs, self.kv_dtype = self._probe_layers()

    def _probe_layers(self) -> tuple[list[LayerKVSpec], torch.dtype]:
        """Each layer's KV layout (``LayerKVSpec``, KV sharing included), from one stubbed forward."""
        probe = self.probe_forward(1, track_sharing=True)
        if len(probe.specs) != self.num_layers or probe.layers_called != self.num_layers:
            self.restore()
            raise UnsupportedModelError(
                f"{type(self.model).__name__}: only {probe.layers_called} of {self.num_layers} layers called the "
                "kvpage attention; the others bypass transformers' attention interface (or have no attention)"
            )
        return [probe.specs[i] for i in range(self.num_layers)], probe.dtype

    def probe_forward(self, num_tokens: int, forward: Optional[CompiledForward] = None,
                      track_sharing: bool = False) -> ProbeContext:
        """A forward of ``num_tokens`` dummy tokens with attention stubbed out (layouts, memory,
        compilation); through ``forward`` if given, else the eager model."""
        probe = ProbeContext(num_real_tokens=num_tokens, track_sharing=track_sharing)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        rows = torch.tensor([num_tokens - 1], device=self.device)
        with torch.inference_mode(), paged_step(probe):
            if forward is not None:
                forward(ids, positions, rows)
            else:
                self.model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False,
                           kvpage_context=probe, **({"logits_to_keep": 1} if self._takes_logits_to_keep else {}))
        return probe

    def compile(self) -> float:
        """Run every later step through ``torch.compile``; compiles now. Returns the seconds taken."""
        self.compiled = CompiledForward(self.model, self._takes_logits_to_keep)
        return self.compiled.warm_up(lambda forward, n: self.probe_forward(n, forward))

    def bind(self, kv_cache: PagedKVCache, backend: AttentionBackend) -> None:
        """Attach the paged KV buffers (a ``PagedKVCache``) and the attention backend."""
        if kv_cache.spec.num_layers != self.num_layers:
            raise ValueError(f"expected a KV cache of {self.num_layers} layers, got {kv_cache.spec.num_layers}")
        self.kv_cache = kv_cache
        self.key_caches = [kv_cache.torch_key_cache(i) for i in range(self.num_layers)]
        self.value_caches = [kv_cache.torch_value_cache(i) for i in range(self.num_layers)]
        self.reading_only = frozenset(i for i, layer in enumerate(kv_cache.spec.layers) if layer.reuses is not None)
        self.backend = backend

    @torch.inference_mode()
    def execute(self, metadata: StepMetadata) -> torch.Tensor:
        if len(metadata.block_copies):
            self.kv_cache.copy_blocks(metadata.block_copies)  # copy-on-write, before any KV write
        device = self.device
        input_ids = torch.as_tensor(metadata.input_ids, device=device)
        positions = torch.as_tensor(metadata.positions, device=device)
        rows = torch.as_tensor(metadata.logits_indices, dtype=torch.long, device=device)
        context = PagedForwardContext(self.key_caches, self.value_caches, self.backend, self.backend.prepare(metadata),
                                      num_real_tokens=metadata.num_tokens, reading_only=self.reading_only)
        with paged_step(context):
            if self.compiled is not None:
                logits = self.compiled(input_ids, positions, rows)
            else:
                logits = self._eager_forward(input_ids, positions, rows, context)
        if context.layers_called != self.num_layers:
            raise RuntimeError(f"{self.num_layers - context.layers_called} layers bypassed kvpage attention")
        return logits.float()

    def _eager_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                       context: PagedForwardContext) -> torch.Tensor:
        kwargs = dict(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False,
                      kvpage_context=context)
        if self._takes_logits_to_keep:
            return self.model(logits_to_keep=rows, **kwargs).logits[0]
        return self.model(**kwargs).logits[0][rows]

    def restore(self) -> None:
        """Switch the model back to the attention implementation and linears it had before."""
        self.model.set_attn_implementation(self.original_attn_implementation)
        self._undo_linears()
