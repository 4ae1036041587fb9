"""Runs one scheduled step through a Hugging Face model with paged KV.

Implements ``kvpage.interfaces.ModelRunner``: ``execute(metadata)`` takes a
``StepMetadata`` and returns float32 logits ``[S, vocab]`` for ``metadata.logits_indices``
(in that order). The model sees one
flattened ragged batch ``[1, T]``; attention reads and writes the paged buffers.
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch

from kvpage.core.kv_groups import KVCacheGroups
from kvpage.core.metadata import StepMetadata
from kvpage.kv_storage import LayerKVSpec, PagedKVCache

from .compiled_forward import CompiledForward
from .layer_kinds import unsupported_layer_reason
from .onednn_linear import use_onednn_linears
from .position_relay import relay_position_ids
from .hf_attention import (ATTN_IMPLEMENTATION, AttentionBackend, PagedForwardContext, ProbeContext, paged_step,
                           register_kvpage_attention)


class UnsupportedModelError(ValueError):
    """The model cannot run on kvpage (its attention bypasses the attention interface, it has
    layers with recurrent state, ...); the message names the reason."""


def check_supported(model: torch.nn.Module) -> None:
    """Raise ``UnsupportedModelError`` naming the reason when ``model`` cannot be paged."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise UnsupportedModelError(f"{name} is not a transformers PreTrainedModel")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; kvpage serves decoder-only models")
    reason = unsupported_layer_reason(model)
    if reason is not None:
        raise UnsupportedModelError(f"{name}: {reason}")
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
        self._undo_position_relay: Callable[[], None] = lambda: None
        self.num_layers = int(model.config.get_text_config().num_hidden_layers)
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.kv_cache: Optional[PagedKVCache] = None
        self.key_caches: list = []
        self.value_caches: list = []
        self.backend: Optional[AttentionBackend] = None
        self.compiled: Optional[CompiledForward] = None  # set by compile()
        self.reading_only: frozenset = frozenset()
        self.site_layers: list = []  # the layer of each attention call site (see PagedForwardContext)
        self.first_site: Optional[list] = None
        self.site_group: Optional[list] = None  # hybrid KV groups: each site's group
        self.layer_specs, self.kv_dtype = self._probe_layers()

    def _probe_layers(self) -> tuple[list[LayerKVSpec], torch.dtype]:
        """Each attention call site's KV layout (``LayerKVSpec``, KV sharing included), from a
        stubbed forward; refuses (restoring the model) what kvpage cannot page exactly."""
        try:
            probe = self.probe_forward(3, track_sharing=True)
            sites = probe.sites()
            self._check_probe(probe, sites)
        except BaseException:
            self.restore()
            raise
        self.site_layers = [layer for layer, _ in sites]
        first = {}
        for site, layer in enumerate(self.site_layers):
            first.setdefault(layer, site)
        self.first_site = None if self.site_layers == list(range(self.num_layers)) else \
            [first.get(layer, 0) for layer in range(max(self.site_layers) + 1)]
        return [spec for _, spec in sites], probe.dtype

    def _check_probe(self, probe: ProbeContext, sites: list) -> None:
        name = type(self.model).__name__
        # Every layer calls attention at least once per forward; some call it more often (twice
        # for differential attention, once per recurrence cycle for HRM's reused stacks).
        called = sorted({layer for layer, _ in sites})
        if len(sites) < self.num_layers:
            raise UnsupportedModelError(
                f"{name}: {len(sites)} attention calls for {self.num_layers} layers (layers called: {called or 'none'}); "
                "the others bypass transformers' attention interface (or have no attention)")
        if probe.layers_with_masks:
            layer = min(probe.layers_with_masks)
            raise UnsupportedModelError(
                f"{name}: layer {layer} hands attention a mask or bias of its own making; kvpage derives causal and "
                "sliding-window masks from token positions and applies no other mask")
        if not self._follows_position_ids() and not self._relay_position_ids():
            raise UnsupportedModelError(
                f"{name} ignores position_ids (it numbers tokens from its own cache length), so it cannot run "
                "kvpage's flattened batches of sequences at different positions")

    def _relay_position_ids(self) -> bool:
        """For a model that numbers positions itself: hand ``position_ids`` to its positional
        embeddings (``position_relay``) and keep that when the model then follows them."""
        undo = relay_position_ids(self.model)
        if undo is None:
            return False
        if not self._follows_position_ids():
            undo()
            return False
        self._undo_position_relay = undo
        return True

    def _follows_position_ids(self) -> bool:
        """Whether the model places tokens where ``position_ids`` says: the first layer's query
        of a token must not change when an earlier token joins the forward at the same
        positions (a model that counts positions itself moves it by one)."""
        alone = self.probe_forward(1, record_query=True, first_position=5, token=7)
        paired = self.probe_forward(2, record_query=True, first_position=4, token=7)
        if alone.first_query is None or paired.first_query is None:
            return True
        return bool(torch.allclose(alone.first_query[-1], paired.first_query[-1], rtol=1e-4, atol=1e-5))

    def probe_forward(self, num_tokens: int, forward: Optional[CompiledForward] = None,
                      track_sharing: bool = False, record_query: bool = False, first_position: int = 0,
                      token: int = 0) -> ProbeContext:
        """A forward of ``num_tokens`` dummy tokens (all ``token``) at positions from
        ``first_position``, attention stubbed out (layouts, memory, compilation); through
        ``forward`` if given, else the eager model."""
        probe = ProbeContext(num_real_tokens=num_tokens, track_sharing=track_sharing, record_query=record_query)
        ids = torch.full((num_tokens,), token, dtype=torch.long, device=self.device)
        positions = torch.arange(first_position, first_position + num_tokens, device=self.device)
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
        """Attach the paged KV buffers (a ``PagedKVCache``, with its KV groups) and the
        attention backend."""
        if kv_cache.spec.num_layers != len(self.layer_specs):
            raise ValueError(f"expected a KV cache of {len(self.layer_specs)} attention sites, got "
                             f"{kv_cache.spec.num_layers}")
        self.kv_cache = kv_cache
        self.key_caches = [kv_cache.torch_key_cache(i) for i in range(kv_cache.spec.num_layers)]
        self.value_caches = [kv_cache.torch_value_cache(i) for i in range(kv_cache.spec.num_layers)]
        self.reading_only = frozenset(i for i, layer in enumerate(kv_cache.spec.layers) if layer.reuses is not None)
        groups: Optional[KVCacheGroups] = kv_cache.groups
        self.site_group = None if groups is None else \
            [groups.position_of_layer(site)[0] for site in range(kv_cache.spec.num_layers)]
        self.backend = backend

    @torch.inference_mode()
    def execute(self, metadata: StepMetadata) -> torch.Tensor:
        if len(metadata.block_copies):
            self.kv_cache.copy_blocks(metadata.block_copies)  # copy-on-write, before any KV write
        device = self.device
        input_ids = torch.as_tensor(metadata.input_ids, device=device)
        positions = torch.as_tensor(metadata.positions, device=device)
        rows = torch.as_tensor(metadata.logits_indices, dtype=torch.long, device=device)
        prepared = self.backend.prepare(metadata)
        site_prepared = None
        if self.site_group is not None:
            by_group = [prepared] + [self.backend.prepare(metadata.for_group(g)) for g in range(1, metadata.num_groups)]
            site_prepared = [by_group[g] for g in self.site_group]
        context = PagedForwardContext(self.key_caches, self.value_caches, self.backend, prepared,
                                      num_real_tokens=metadata.num_tokens, reading_only=self.reading_only,
                                      first_site=self.first_site, site_prepared=site_prepared)
        with paged_step(context):
            if self.compiled is not None:
                logits = self.compiled(input_ids, positions, rows)
            else:
                logits = self._eager_forward(input_ids, positions, rows, context)
        if context.layers_called != len(self.layer_specs):
            raise RuntimeError(f"{len(self.layer_specs) - context.layers_called} attention calls bypassed kvpage "
                               "attention")
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
        self._undo_position_relay()
        self._undo_position_relay = lambda: None
