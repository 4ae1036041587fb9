"""Runs one scheduled step through a Hugging Face model with paged KV.

Implements ``kvpage.engine.interfaces.ModelRunner``: ``execute(metadata)`` takes a
``StepMetadata`` and returns float32 logits ``[S, vocab]`` for ``metadata.logits_indices``
(in that order). The model sees one
flattened ragged batch ``[1, T]``; attention reads and writes the paged buffers.

A model with recurrent layers (state-space mixers, gated delta nets, short convolutions)
cannot mix sequences in one row: its step runs as a few forwards of ``[n, L]``, one per
group of sequences with the same query length that all start fresh or all resume, with
their states gathered from and stored back to the state slots (``recurrent_state``).
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from kvpage.core.kv.kv_groups import KVCacheGroups
from kvpage.core.sched.metadata import StepMetadata
from kvpage.storage.kv_storage import LayerKVSpec, PagedKVCache

from .attention_ports import alibi_slopes_by_layer, install_ports, mask_alibi_slopes, needs_port, port_refusal
from .compiled_forward import CompiledForward
from .layer_kinds import attention_modules, attention_modules_of_layer, unsupported_layer_reason
from .onednn_linear import use_onednn_linears
from .position_relay import relay_position_ids
from .recurrent_state import (RecurrentStateSlots, StateEntry, chunked_prefill_is_exact, probe_state_layout,
                              state_argument)
from .hf_attention import (ATTN_IMPLEMENTATION, AttentionBackend, PagedForwardContext, ProbeContext, paged_step,
                           register_kvpage_attention)
from .sparse_indexer import has_indexers, install_indexer_ports


class UnsupportedModelError(ValueError):
    """The model cannot run on kvpage (its attention bypasses the attention interface, it has
    layers with recurrent state, ...); the message names the reason."""


def check_supported(model: torch.nn.Module) -> list[StateEntry]:
    """Raise ``UnsupportedModelError`` naming the reason when ``model`` cannot be paged;
    return the recurrent states it keeps in transformers' ``Cache`` (empty for an
    attention-only model), which kvpage keeps in state slots."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise UnsupportedModelError(f"{name} is not a transformers PreTrainedModel")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; kvpage serves decoder-only models")
    reason = unsupported_layer_reason(model, state_in_cache=True)
    if reason is not None:
        raise UnsupportedModelError(f"{name}: {reason}")
    layout: list[StateEntry] = []
    recurrent_reason = unsupported_layer_reason(model)
    if recurrent_reason is not None:
        try:
            layout = probe_state_layout(model)
        except Exception as exc:  # noqa: BLE001 - the reason names the layer; the probe's failure adds why
            raise UnsupportedModelError(f"{name}: {recurrent_reason} (its cache probe failed: "
                                        f"{type(exc).__name__}: {exc})") from exc
        if not layout:
            raise UnsupportedModelError(f"{name}: {recurrent_reason}")
    if needs_port(model):
        refusal = port_refusal(model)
        if refusal is not None:
            raise UnsupportedModelError(f"{name}: {refusal}")
    elif not type(model)._can_set_attn_implementation() and not text_decoder_switchable(model) \
            and not (layout and not attention_modules(model)):  # RWKV: state alone, nothing to switch
        raise UnsupportedModelError(
            f"{name}'s attention does not go through transformers' AttentionInterface, so kvpage cannot page its KV")
    return layout


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


class HFModelRunner:
    """Owns the model's switch to kvpage attention and one forward per step."""

    def __init__(self, model: torch.nn.Module, onednn_linears: bool = False) -> None:
        self.state_layout = check_supported(model)
        # Whether a prompt may be fed in chunks: the model's prefill resumes from stored state.
        self.chunks_resume_state = not self.state_layout or chunked_prefill_is_exact(model)
        self.state_argument = state_argument(model) if self.state_layout else None
        self.state_slots: Optional[RecurrentStateSlots] = None  # set by allocate_state_slots()
        self.model = model
        self.device = next(model.parameters()).device
        self.original_attn_implementation = model.config._attn_implementation
        register_kvpage_attention()
        # A family whose attention is inline gets ports (attention_ports) instead of the
        # switch; a composite model whose text decoder alone follows the interface gets
        # the switch for its text config only.
        switchable = type(model)._can_set_attn_implementation()
        self._ported = needs_port(model)
        self._text_only = not switchable and not self._ported and text_decoder_switchable(model)
        self._undo_ports = install_ports(model) if self._ported else (lambda: None)
        # DSA models: each indexer becomes one more paged site of its layer (sparse_indexer).
        self.sparse_indexers = has_indexers(model)
        if self.sparse_indexers and self.device.type != "cpu":
            raise UnsupportedModelError(f"{type(model).__name__}: kvpage serves DeepSeek sparse attention (DSA "
                                        "indexers) on CPU only; its CUDA kernels attend densely")
        self._undo_indexers = install_indexer_ports(model) if self.sparse_indexers else (lambda: None)
        # An interface family that folds ALiBi into its mask: kvpage adds the slopes itself,
        # and hands the model a placeholder mask to fold them into (then ignores the result).
        self._mask_alibi = mask_alibi_slopes(model)  # {} for a ported model
        self._mask_placeholder = self.sparse_indexers or bool(self._mask_alibi)
        if self._text_only:
            self.original_attn_implementation = {"text_config": model.config.text_config._attn_implementation}
            model.set_attn_implementation({"text_config": ATTN_IMPLEMENTATION})
        elif not self._ported and switchable:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self._switched = not self._ported and (switchable or self._text_only)
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
        self.site_chunks: Optional[list] = None  # each site's attention chunk, where some layer attends in chunks
        self.site_alibi: Optional[list] = None  # each site's ALiBi slopes, for ported ALiBi families
        self.site_layers: list = []  # the layer of each attention call site (see PagedForwardContext)
        self.first_site: Optional[dict] = None
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
        dtype = probe.dtype or next(self.model.parameters()).dtype  # no attention: the weights' dtype
        first: dict = {}
        for site, layer in enumerate(self.site_layers):
            first.setdefault(layer, site)
        self.first_site = None if self.site_layers == list(range(self.num_layers)) else first
        return [spec for _, spec in sites], dtype

    def _check_probe(self, probe: ProbeContext, sites: list) -> None:
        name = type(self.model).__name__
        # Every layer calls attention at least once per forward; some call it more often (twice
        # for differential attention, once per recurrence cycle for HRM's reused stacks).
        called = sorted({layer for layer, _ in sites})
        stateful = {entry.layer for entry in self.state_layout}
        # In a recurrent model a layer may be neither (an MLP-only layer), unless it has an
        # attention module that did not come through the interface.
        silent = sorted(set(range(self.num_layers)) - set(called) - stateful) if stateful else []
        bypassing = {layer: modules for layer in silent if (modules := attention_modules_of_layer(self.model, layer))}
        if bypassing:
            first = next(iter(bypassing.values()))[0]
            raise UnsupportedModelError(
                f"{name}: layers {sorted(bypassing)} have attention ({first}) that bypasses transformers' attention "
                "interface")
        if not stateful and len(sites) < self.num_layers:
            raise UnsupportedModelError(
                f"{name}: {len(sites)} attention calls for {self.num_layers} layers (layers called: {called or 'none'}); "
                "the others bypass transformers' attention interface (or have no attention)")
        if probe.foreign_calls:
            layer, rows = probe.foreign_calls[0]
            raise UnsupportedModelError(
                f"{name}: an attention call of layer {layer} attends over {rows} rows for {probe.num_real_tokens} "
                "tokens (across something other than the sequence); kvpage pages attention over a sequence's "
                "tokens only")
        # (A family folding ALiBi into its mask hands attention that fold; kvpage adds the slopes.)
        if probe.layers_with_masks and not self._mask_alibi:
            layer = min(probe.layers_with_masks)
            raise UnsupportedModelError(
                f"{name}: layer {layer} hands attention a mask or bias of its own making; kvpage derives causal and "
                "sliding-window masks from token positions and applies no other mask")
        # A recurrent layer ahead of the first attention makes a token's query depend on the
        # tokens before it, which the probe below cannot tell from a position shift; models
        # with recurrent layers all come from transformers' position_ids era.
        if not stateful and not self._follows_position_ids() and not self._relay_position_ids():
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
                      token: int = 0, sampled_rows: int = 1) -> ProbeContext:
        """A forward of ``num_tokens`` dummy tokens (all ``token``) at positions from
        ``first_position``, attention stubbed out (layouts, memory, compilation), logits for
        the last ``sampled_rows``; through ``forward`` if given, else the eager model."""
        probe = ProbeContext(num_real_tokens=num_tokens, track_sharing=track_sharing, record_query=record_query,
                             mask_placeholder=self._mask_placeholder)
        # Inputs made under inference mode, as execute() makes them: a compiled forward's
        # warm-up then builds the very entry the steps use (tensors made outside it carry
        # another dispatch key set, and the first real step compiled a second entry).
        with torch.inference_mode():
            ids = torch.full((num_tokens,), token, dtype=torch.long, device=self.device)
            positions = torch.arange(first_position, first_position + num_tokens, device=self.device)
            rows = torch.arange(num_tokens - sampled_rows, num_tokens, device=self.device)
        with torch.inference_mode(), paged_step(probe):
            if forward is not None:
                forward(ids, positions, rows)
            else:
                self.model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False,
                           kvpage_context=probe,
                           **({"logits_to_keep": sampled_rows} if self._takes_logits_to_keep else {}))
        return probe

    def compile(self, max_num_seqs: int = 0, other_thread_counts: Sequence[int] = ()) -> float:
        """Run every later step through ``torch.compile``; compiles now, and warms the
        decode steps of up to ``max_num_seqs`` sequences, at the current thread count and at
        each of ``other_thread_counts``. Returns the seconds taken.
        A model with an ``eager_reason`` (recurrent layers, DSA indexers, ALiBi folded into
        its mask) stays eager, and this returns 0."""
        if self.eager_reason is not None:
            return 0.0
        self.compiled = CompiledForward(self.model, self._takes_logits_to_keep)
        return self.compiled.warm_up(lambda forward, n, s: self.probe_forward(n, forward, sampled_rows=s),
                                     max_decode_rows=max_num_seqs, other_thread_counts=other_thread_counts)

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
        chunks = [layer.attention_chunk for layer in kv_cache.spec.layers]
        self.site_chunks = chunks if any(chunks) else None
        slopes = alibi_slopes_by_layer(self.model) if self._ported else self._mask_alibi
        self.site_alibi = [slopes.get(layer) for layer in self.site_layers] if slopes else None
        groups: Optional[KVCacheGroups] = kv_cache.groups
        self.site_group = None if groups is None else \
            [groups.position_of_layer(site)[0] for site in range(kv_cache.spec.num_layers)]
        self.backend = backend

    @property
    def uses_alibi(self) -> bool:
        """Whether some attention site adds ALiBi position biases (an ALiBi family, ported or
        folding them into its mask)."""
        return bool(self._mask_alibi) or (self._ported and bool(alibi_slopes_by_layer(self.model)))

    @property
    def eager_reason(self) -> Optional[str]:
        """Why this model's steps run eager whatever the settings, or None when they compile."""
        if self.state_layout:
            return "a model with recurrent layers runs eager (several forwards per step, a cache object per forward)"
        if self.sparse_indexers:
            return "a model with DeepSeek sparse attention runs eager (its indexers run per sequence)"
        if self._mask_alibi:
            return ("a model that folds ALiBi into its attention mask runs eager (the compiled graph builds no "
                    "mask to fold it into)")
        return None

    def allocate_state_slots(self, num_slots: int) -> int:
        """Allocate ``num_slots`` slots of every recurrent state (nothing for an
        attention-only model); returns their bytes."""
        if not self.state_layout:
            return 0
        self.state_slots = RecurrentStateSlots(self.model, self.state_layout, num_slots, self.device)
        return self.state_slots.nbytes

    @torch.inference_mode()
    def execute(self, metadata: StepMetadata) -> torch.Tensor:
        if len(metadata.block_copies):
            self.kv_cache.copy_blocks(metadata.block_copies)  # copy-on-write, before any KV write
        if self.state_slots is not None:
            return self._execute_stateful(metadata)
        device = self.device
        input_ids = torch.as_tensor(metadata.input_ids, device=device)
        positions = torch.as_tensor(metadata.positions, device=device)
        rows = torch.as_tensor(metadata.logits_indices, dtype=torch.long, device=device)
        context = self._context(metadata)
        with paged_step(context):
            if self.compiled is not None:
                logits = self.compiled(input_ids, positions, rows)
            else:
                logits = self._eager_forward(input_ids, positions, rows, context)
        if context.layers_called != len(self.layer_specs):
            raise RuntimeError(f"{len(self.layer_specs) - context.layers_called} attention calls bypassed kvpage "
                               "attention")
        return logits.float()

    def _context(self, metadata: StepMetadata) -> PagedForwardContext:
        prepared = self.backend.prepare(metadata)
        site_prepared = None
        if self.site_group is not None:
            by_group = [prepared] + [self.backend.prepare(metadata.for_group(g)) for g in range(1, metadata.num_groups)]
            site_prepared = [by_group[g] for g in self.site_group]
        return PagedForwardContext(self.key_caches, self.value_caches, self.backend, prepared,
                                   num_real_tokens=metadata.num_tokens, reading_only=self.reading_only,
                                   first_site=self.first_site, site_prepared=site_prepared,
                                   site_chunks=self.site_chunks, site_alibi=self.site_alibi, metadata=metadata,
                                   mask_placeholder=self._mask_placeholder)

    def _execute_stateful(self, metadata: StepMetadata) -> torch.Tensor:
        """The step as one forward ``[n, L]`` per group of sequences sharing a query length
        and a start (fresh or resumed), their states gathered from and stored to the slots."""
        slots = self.state_slots
        if len(metadata.state_copies):
            slots.copy(metadata.state_copies)  # forks, before any state moves on
        if len(metadata.state_slots) != metadata.num_seqs or (metadata.state_slots < 0).any():
            raise ValueError("a step of a model with recurrent layers must give every sequence a state slot")
        query_lens = np.diff(metadata.query_start_loc)
        resumes = metadata.num_computed_tokens > 0
        wanted = metadata.logits_indices
        logits: Optional[torch.Tensor] = None
        keys = query_lens * 2 + resumes
        for key in np.unique(keys).tolist():
            group = np.flatnonzero(keys == key)
            limit = slots.carrier.batch_limit(int(key // 2)) or len(group)
            for start in range(0, len(group), limit):
                part, rows = metadata.select(group[start:start + limit])
                # The step's rows whose logits are wanted, and where they sit in this part.
                picked = np.flatnonzero(np.isin(wanted, rows))
                part_logits = self._stateful_forward(part, bool(key % 2), np.searchsorted(rows, wanted[picked]))
                if logits is None:
                    logits = part_logits.new_empty((len(wanted), part_logits.shape[-1]))
                logits[torch.as_tensor(picked, device=logits.device)] = part_logits
        return logits.float()

    def _stateful_forward(self, part: StepMetadata, resume: bool, logit_rows: np.ndarray) -> torch.Tensor:
        """One forward of ``part`` (sequences of equal query length); logits of ``logit_rows``."""
        device = self.device
        num_seqs = part.num_seqs
        ids = torch.as_tensor(part.input_ids, device=device).view(num_seqs, -1)
        positions = torch.as_tensor(part.positions, device=device).view(num_seqs, -1)
        slot_ids = torch.as_tensor(part.state_slots, device=device)
        cache = self.state_slots.cache_for(slot_ids, resume)
        context = self._context(part)
        length = ids.shape[1]
        seq_of_row, offset_of_row = np.divmod(logit_rows, length)
        offsets = np.unique(offset_of_row)  # the in-sequence offsets any sequence needs logits at
        kwargs = {}
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = torch.as_tensor(offsets, device=device)
        with paged_step(context):
            out = self.model(input_ids=ids, position_ids=positions, use_cache=True, kvpage_context=context,
                             **{self.state_argument: cache}, **kwargs)
        if context.layers_called != len(self.layer_specs):
            raise RuntimeError(f"{len(self.layer_specs) - context.layers_called} attention calls bypassed kvpage "
                               "attention")
        self.state_slots.store(cache, slot_ids)
        logits = out.logits
        columns = np.searchsorted(offsets, offset_of_row) if self._takes_logits_to_keep else offset_of_row
        return logits[torch.as_tensor(seq_of_row, device=logits.device), torch.as_tensor(columns, device=logits.device)]

    def _eager_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                       context: PagedForwardContext) -> torch.Tensor:
        kwargs = dict(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False,
                      kvpage_context=context)
        if self._takes_logits_to_keep:
            return self.model(logits_to_keep=rows, **kwargs).logits[0]
        return self.model(**kwargs).logits[0][rows]

    def restore(self) -> None:
        """Switch the model back to the attention implementation and linears it had before."""
        self._undo_ports()
        self._undo_ports = lambda: None
        self._undo_indexers()
        self._undo_indexers = lambda: None
        if self._switched:
            self.model.set_attn_implementation(self.original_attn_implementation)
        self._undo_linears()
        self._undo_position_relay()
        self._undo_position_relay = lambda: None
