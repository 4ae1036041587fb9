"""Runs one scheduled step through a Hugging Face model with paged KV.

Implements ``kvpage.engine.interfaces.ModelRunner``: ``execute(metadata)`` takes a
``StepMetadata`` and returns float32 logits ``[S, vocab]`` for ``metadata.logits_indices``
(in that order). The model sees one flattened ragged batch ``[1, T]``; attention reads and
writes the paged buffers of its call sites (``forward_context``), bound for each forward.

A model with recurrent layers (state-space mixers, gated delta nets, short convolutions)
cannot mix sequences in one row: its step runs as a few forwards of ``[n, L]``, one per
group of sequences with the same query length that all start fresh or all resume, with
their states gathered from and stored back to the state slots (``recurrent_state``).

Every change the runner makes to the model (its attention switched or ported, oneDNN
linears, position relays) pushes its undo onto one stack, which ``restore()`` unwinds.
"""
from __future__ import annotations

import contextlib
import inspect
import time
from typing import Optional, Sequence

import numpy as np
import torch

from kvpage.core.sched.metadata import StepMetadata
from kvpage.storage.paged_cache import PagedKVCache
from kvpage.storage.spec import LayerKVSpec

from .compiled_forward import CompiledForward
from .decode_graphs import (CudaGraphCapture, DecodeGraphs, GraphCapture, StaticDecodeBuffers, capture_decode_graphs,
                            capture_sizes)
from .families import needs_port, port_refusal
from .forward_context import AttentionBackend, AttentionSite, ProbeContext, StepContext, forward_context
from .layer_kinds import attention_modules, attention_modules_of_layer, unsupported_layer_reason
from .onednn_linear import onednn_available, pick_compute_dtype, use_onednn_linears
from .row_tiled_linear import use_row_tiled_linears
from .position_relay import relay_position_ids
from .recurrent_state import (RecurrentStateSlots, StateEntry, chunked_prefill_is_exact, probe_state_layout,
                              state_argument)
from .sparse_indexer import has_indexers
from .takeover import Takeover, take_over, text_decoder_switchable


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
    layout = _recurrent_layout(model)
    if needs_port(model):
        refusal = port_refusal(model)
        if refusal is not None:
            raise UnsupportedModelError(f"{name}: {refusal}")
    elif not type(model)._can_set_attn_implementation() and not text_decoder_switchable(model) \
            and not (layout and not attention_modules(model)):  # RWKV: state alone, nothing to switch
        raise UnsupportedModelError(
            f"{name}'s attention does not go through transformers' AttentionInterface, so kvpage cannot page its KV")
    if has_indexers(model) and next(model.parameters()).device.type != "cpu":
        raise UnsupportedModelError(f"{name}: kvpage serves DeepSeek sparse attention (DSA indexers) on CPU only; "
                                    "its CUDA kernels attend densely")
    return layout


def _recurrent_layout(model: torch.nn.Module) -> list[StateEntry]:
    """The recurrent states of a model with recurrent layers (``[]`` for one without), found
    by a probe; refused when the model keeps them where no carrier reaches."""
    recurrent_reason = unsupported_layer_reason(model)
    if recurrent_reason is None:
        return []
    name = type(model).__name__
    try:
        layout = probe_state_layout(model)
    except Exception as exc:  # noqa: BLE001 - the reason names the layer; the probe's failure adds why
        raise UnsupportedModelError(f"{name}: {recurrent_reason} (its cache probe failed: "
                                    f"{type(exc).__name__}: {exc})") from exc
    if not layout:
        raise UnsupportedModelError(f"{name}: {recurrent_reason}")
    return layout


class HFModelRunner:
    """Owns the model's switch to kvpage attention and one forward per step.

    ``sites`` lists the model's attention call sites (``AttentionSite``: layer, KV layout,
    and once ``bind`` ran, buffers, KV group and ALiBi slopes) in site order, the KV cache's
    layer order; ``layer_specs`` their layouts."""

    def __init__(self, model: torch.nn.Module, onednn_linears: bool = False,
                 linear_compute_dtype: str = "auto", row_tiled_linears: bool = False) -> None:
        self.state_layout = check_supported(model)
        # Whether a prompt may be fed in chunks: the model's prefill resumes from stored state.
        self.chunks_resume_state = not self.state_layout or chunked_prefill_is_exact(model)
        self.state_argument = state_argument(model) if self.state_layout else None
        self.state_slots: Optional[RecurrentStateSlots] = None  # set by allocate_state_slots()
        self.model = model
        self.device = next(model.parameters()).device
        self.num_layers = int(model.config.get_text_config().num_hidden_layers)
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.kv_cache: Optional[PagedKVCache] = None
        self.backend: Optional[AttentionBackend] = None
        self.compiled: Optional[CompiledForward] = None  # set by compile()
        self.decode_graphs: Optional[DecodeGraphs] = None  # set by capture_decode_graphs()
        self.sites: list[AttentionSite] = []
        self._calls: list[AttentionSite] = []  # the site of each attention call of a forward, in call order
        self._undo = contextlib.ExitStack()  # the changes made to the model, undone by restore()
        try:
            self.takeover: Takeover = take_over(model, self._undo, recurrent=bool(self.state_layout))
            self.onednn_linears = bool(onednn_linears) and onednn_available(model)
            # The dtype the oneDNN linears compute in, and why (None without them).
            self.linear_compute: Optional[tuple[torch.dtype, str]] = None
            if self.onednn_linears:
                self.linear_compute = pick_compute_dtype(model, linear_compute_dtype)
                self._undo.callback(use_onednn_linears(model, self.linear_compute[0]))
            elif row_tiled_linears:  # batch-invariant linears (EngineConfig.batch_invariant)
                if self.state_layout:
                    raise UnsupportedModelError("batch_invariant covers attention models: this one carries "
                                                "recurrent state, whose updates it does not tile")
                self._undo.callback(use_row_tiled_linears(model))
            self.kv_dtype = self._probe_sites()
        except BaseException:
            self.restore()
            raise

    @property
    def layer_specs(self) -> list[LayerKVSpec]:
        """Each attention call site's KV layout, in site order (KV sharing included)."""
        return [site.spec for site in self.sites]

    def _probe_sites(self) -> torch.dtype:
        """Find each attention call site (``AttentionSite``) from a stubbed forward, refusing
        what kvpage cannot page exactly; returns the KV dtype."""
        probe = self.probe_forward(3, track_sharing=True)
        sites, call_order = probe.site_layout()
        self._check_sites(sites)
        self._check_calls(probe)
        self.sites = sites
        self._calls = [sites[site] for site in call_order]
        return probe.dtype or next(self.model.parameters()).dtype  # no attention: the weights' dtype

    def _check_sites(self, sites: list[AttentionSite]) -> None:
        """Every layer calls attention at least once per forward (some more often: twice for
        differential attention, once per recurrence cycle for HRM's reused stacks); in a
        recurrent model a layer may call none (an MLP-only layer) unless it has an attention
        module that did not come through the interface."""
        name = type(self.model).__name__
        called = sorted({site.layer for site in sites})
        stateful = {entry.layer for entry in self.state_layout}
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

    def _check_calls(self, probe: ProbeContext) -> None:
        """Each call attends over the forward's tokens, with no mask of the model's making,
        at the positions ``position_ids`` gives."""
        name = type(self.model).__name__
        if probe.foreign_calls:
            layer, rows = probe.foreign_calls[0]
            raise UnsupportedModelError(
                f"{name}: an attention call of layer {layer} attends over {rows} rows for {probe.num_real_tokens} "
                "tokens (across something other than the sequence); kvpage pages attention over a sequence's "
                "tokens only")
        # (A family folding ALiBi into its mask hands attention that fold; kvpage adds the slopes.)
        if probe.layers_with_masks and not self.takeover.mask_alibi:
            layer = min(probe.layers_with_masks)
            raise UnsupportedModelError(
                f"{name}: layer {layer} hands attention a mask or bias of its own making; kvpage derives causal and "
                "sliding-window masks from token positions and applies no other mask")
        # A recurrent layer ahead of the first attention makes a token's query depend on the
        # tokens before it, which the probe below cannot tell from a position shift; models
        # with recurrent layers all come from transformers' position_ids era.
        if not self.state_layout and not self._follows_position_ids() and not self._relay_position_ids():
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
        self._undo.callback(undo)
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
                             mask_placeholder=self.takeover.mask_placeholder)
        # Inputs made under inference mode, as execute() makes them: a compiled forward's
        # warm-up then builds the very entry the steps use (tensors made outside it carry
        # another dispatch key set, and the first real step compiled a second entry).
        with torch.inference_mode():
            ids = torch.full((num_tokens,), token, dtype=torch.long, device=self.device)
            positions = torch.arange(first_position, first_position + num_tokens, device=self.device)
            rows = torch.arange(num_tokens - sampled_rows, num_tokens, device=self.device)
        with torch.inference_mode(), forward_context(probe):
            if forward is not None:
                forward(ids, positions, rows)
            else:
                self.model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False,
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

    def graph_refusal(self, capture: Optional[GraphCapture] = None) -> Optional[str]:
        """Why this runner's decode steps cannot be captured in graphs (None: they can), once
        bound; ``capture`` None means CUDA graphs."""
        if capture is None and self.device.type != "cuda":
            return "CUDA graphs need the model on a CUDA device"
        if self.backend is None or getattr(self.backend, "prepare_graphed", None) is None:
            return f"the {getattr(self.backend, 'name', 'unbound')} attention backend has no graphed decode"
        if self.state_layout:
            return "recurrent layers run their steps as several forwards"
        if any(site.spec.attention_chunk or site.alibi_slopes is not None for site in self.sites):
            return "chunked attention and ALiBi run on the eager path"
        if has_indexers(self.model):
            return "DSA indexers select keys on the host"
        return None

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int,
                              capture: Optional[GraphCapture] = None) -> float:
        """Capture the decode steps of 1 to ``max_num_seqs`` sequences (``capture_sizes``) of
        contexts up to ``max_model_len``, through ``capture`` (None: CUDA graphs); later
        decode steps that fit replay them. Refuses (``ValueError``) when ``graph_refusal``
        names a reason; ``RuntimeError`` when a replay does not match its eager forward.
        Returns the seconds taken."""
        reason = self.graph_refusal(capture)
        if reason is not None:
            raise ValueError(f"decode graphs: {reason}")
        start = time.perf_counter()
        sizes = capture_sizes(max_num_seqs)
        width = -(-int(max_model_len) // self.kv_cache.spec.block_size)
        groups = 1 if self.kv_cache.groups is None else self.kv_cache.groups.num_groups
        buffers = StaticDecodeBuffers(sizes[-1], groups, width, self.device)
        with torch.inference_mode():
            self.decode_graphs = capture_decode_graphs(
                lambda size: self._graphed_forward(buffers, size, int(max_model_len)), buffers, sizes,
                capture or CudaGraphCapture(self.device))
        return time.perf_counter() - start

    def _graphed_forward(self, buffers: StaticDecodeBuffers, size: int, max_seq_len: int):
        """The decode forward of a ``size``-row bucket over ``buffers``, as a closure to capture."""
        ids, positions, rows = buffers.inputs(size)
        prepared = [self.backend.prepare_graphed(indices) for indices in buffers.indices(size, max_seq_len)]
        forward = self.compiled or self._eager_forward

        def run() -> torch.Tensor:
            context = StepContext(self._calls, self.backend, prepared, None, size, self.takeover.mask_placeholder)
            with forward_context(context):
                logits = forward(ids, positions, rows)
            self._check_every_call_made(context)
            return logits

        return run

    def bind(self, kv_cache: PagedKVCache, backend: AttentionBackend) -> None:
        """Attach the paged KV buffers (a ``PagedKVCache``, with its KV groups) and the
        attention backend: each site gets its buffers, KV group and ALiBi slopes."""
        if kv_cache.spec.num_layers != len(self.sites):
            raise ValueError(f"expected a KV cache of {len(self.sites)} attention sites, got "
                             f"{kv_cache.spec.num_layers}")
        slopes = self.takeover.alibi_slopes(self.model)
        groups = kv_cache.groups
        for index, site in enumerate(self.sites):
            site.key_cache = kv_cache.torch_key_cache(index)
            site.value_cache = kv_cache.torch_value_cache(index)
            site.group = 0 if groups is None else groups.position_of_layer(index)[0]
            site.alibi_slopes = slopes.get(site.layer)
        self.kv_cache = kv_cache
        self.backend = backend

    @property
    def uses_alibi(self) -> bool:
        """Whether some attention site adds ALiBi position biases (an ALiBi family, ported or
        folding them into its mask)."""
        return bool(self.takeover.alibi_slopes(self.model))

    @property
    def eager_reason(self) -> Optional[str]:
        """Why this model's steps run eager whatever the settings, or None when they compile."""
        return self.takeover.eager_reason

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
        if self.decode_graphs is not None and self.decode_graphs.serves(metadata):
            return self.decode_graphs.run(metadata).float()
        device = self.device
        input_ids = torch.as_tensor(metadata.input_ids, device=device)
        positions = torch.as_tensor(metadata.positions, device=device)
        rows = torch.as_tensor(metadata.logits_indices, dtype=torch.long, device=device)
        with forward_context(self._step_context(metadata)) as context:
            if self.compiled is not None:
                logits = self.compiled(input_ids, positions, rows)
            else:
                logits = self._eager_forward(input_ids, positions, rows)
        self._check_every_call_made(context)
        return logits.float()

    def _step_context(self, metadata: StepMetadata) -> StepContext:
        """The forward's context: the backend's view of the step for each KV group."""
        prepared = [self.backend.prepare(metadata)]
        prepared += [self.backend.prepare(metadata.for_group(g)) for g in range(1, metadata.num_groups)]
        return StepContext(self._calls, self.backend, prepared, metadata, metadata.num_tokens,
                           self.takeover.mask_placeholder)

    def _check_every_call_made(self, context: StepContext) -> None:
        if context.layers_called != len(self._calls):
            raise RuntimeError(f"{len(self._calls) - context.layers_called} attention calls bypassed kvpage "
                               "attention")

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
        length = ids.shape[1]
        seq_of_row, offset_of_row = np.divmod(logit_rows, length)
        offsets = np.unique(offset_of_row)  # the in-sequence offsets any sequence needs logits at
        kwargs = {}
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = torch.as_tensor(offsets, device=device)
        with forward_context(self._step_context(part)) as context:
            out = self.model(input_ids=ids, position_ids=positions, use_cache=True, **{self.state_argument: cache},
                             **kwargs)
        self._check_every_call_made(context)
        self.state_slots.store(cache, slot_ids)
        logits = out.logits
        columns = np.searchsorted(offsets, offset_of_row) if self._takes_logits_to_keep else offset_of_row
        return logits[torch.as_tensor(seq_of_row, device=logits.device), torch.as_tensor(columns, device=logits.device)]

    def _eager_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        kwargs = dict(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        if self._takes_logits_to_keep:
            return self.model(logits_to_keep=rows, **kwargs).logits[0]
        return self.model(**kwargs).logits[0][rows]

    def restore(self) -> None:
        """Give the model back as it was: its attention implementation, modules and linears."""
        self._undo.close()
