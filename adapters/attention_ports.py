"""kvpage attention for families whose HF attention bypasses transformers' AttentionInterface.

A few families (GPT-Neo, GPT-NeoX-Japanese, Falcon, Bloom, MPT, OpenAI GPT, the Bart-style
decoders of XGLM, TrOCR and MVP, the BERT-style decoders of RemBERT, MegatronBERT, BigBird,
RoFormer and GIT) compute attention inline in their attention module, so there is no interface call for kvpage to
answer. For those, a *port* takes the place of each attention module in its parent, on the
loaded instance (no class is patched), and computes what the original computes with the
original's own weights, submodules and helpers (its head splits, the modeling file's rotary
function), except the attention itself, which goes to ``kvpage_attention_forward``.
``install_ports(model, spec)`` swaps them in and returns the undo; the runner installs them only
while it owns the model, whose forwards then all run inside a kvpage step (a call outside
one would get plain causal SDPA, without windows or ALiBi).

ALiBi families (Bloom, MPT, Falcon's ALiBi variant) build a position-bias tensor over the
forward's rows, which in a kvpage step are many sequences. Their ports ignore it and carry
the heads' slopes instead (``alibi_slopes``, read off the model's own ALiBi builder); the
runner hands them to the attention backend per site, which adds ``slope * key position``
within each sequence. The family registry (``families``) says which ports a family uses
and which of its variants they do not serve.

A family whose modeling file later moves onto the interface stops needing its port: the
runner installs ports only for models that cannot switch attention implementation. Falcon
did so (transformers 5.25) and now folds ALiBi into the mask it builds; ``falcon_mask_alibi_slopes``
gives the runner those slopes instead. Its port stays for the releases before.
"""
from __future__ import annotations

import operator
import sys
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from .hf_attention import kvpage_attention_forward


class _Port(nn.Module):
    """The common part: the original module (``inner``, kept as a child so its weights stay
    where the model's other code expects them to move) and its layer index."""

    alibi_slopes: Optional[torch.Tensor] = None  # float32 [heads], for ALiBi families

    def __init__(self, inner: nn.Module, layer_idx: int, config) -> None:
        super().__init__()
        self.inner = inner
        self.layer_idx = layer_idx
        self.config = config

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                sliding_window: Optional[int] = None) -> torch.Tensor:
        """``[B, H, T, D]`` query and ``[B, H_kv, T, D]`` K/V in; ``[B, T, H * D]`` out."""
        out, _ = kvpage_attention_forward(self, query, key, value, None, scaling=scaling,
                                          sliding_window=sliding_window)
        return out.reshape(*out.shape[:2], -1)


class GPTNeoAttentionPort(_Port):
    """GPT-Neo's self-attention: unscaled scores (its weights absorb the scale), global or
    local (a sliding window of ``config.window_size``) by layer."""

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, layer_past=None, use_cache: bool = False,
                output_attentions: bool = False, **kwargs):
        inner = self.inner
        heads, dim = inner.num_heads, inner.head_dim
        query, key, value = (inner._split_heads(proj(hidden_states), heads, dim)
                             for proj in (inner.q_proj, inner.k_proj, inner.v_proj))
        window = self.config.window_size if inner.attention_type == "local" else None
        out = self._attend(query, key, value, scaling=1.0, sliding_window=window)
        return inner.resid_dropout(inner.out_proj(out)), None


class GPTNeoXJapaneseAttentionPort(_Port):
    """GPT-NeoX-Japanese's attention: fused per-head QKV, partial rotary, scaled by
    ``1/sqrt(head_size)``; like the original it hands back its output bias for the layer
    to add."""

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, layer_past=None,
                use_cache: bool = False, output_attentions: bool = False, position_embeddings=None, **kwargs):
        inner = self.inner
        size, rot = inner.head_size, inner.rotary_ndims
        qkv = inner.query_key_value(hidden_states).view(*hidden_states.shape[:-1], inner.num_attention_heads,
                                                        3 * size)
        query, key, value = (qkv[..., i * size:(i + 1) * size].permute(0, 2, 1, 3) for i in range(3))
        cos, sin = position_embeddings
        apply_rotary = sys.modules[type(inner).__module__].apply_rotary_pos_emb
        query_rot, key_rot = apply_rotary(query[..., :rot], key[..., :rot], cos, sin)
        query = torch.cat((query_rot, query[..., rot:]), dim=-1)
        key = torch.cat((key_rot, key[..., rot:]), dim=-1)
        out = self._attend(query, key, value, scaling=1.0 / inner.norm_factor)
        return inner.dense(out), None, inner.dense_bias


class FalconAttentionPort(_Port):
    """Falcon's attention (every head layout: multi-head, multi-query and the new decoder
    architecture's grouped KV), scaled by ``1/sqrt(head_dim)``, with rotary positions or
    ALiBi (whose bias Falcon scales with the scores). For the transformers releases whose
    Falcon attention is inline (those before its ``_split_heads`` went away)."""

    def __init__(self, inner: nn.Module, layer_idx: int, config) -> None:
        super().__init__(inner, layer_idx, config)
        if config.alibi:
            self.alibi_slopes = _bloom_slopes(inner, inner.num_heads) * inner.inv_norm_factor

    def forward(self, hidden_states: torch.Tensor, alibi=None, attention_mask=None, position_ids=None,
                layer_past=None, use_cache: bool = False, output_attentions: bool = False,
                position_embeddings=None, **kwargs):
        inner = self.inner
        apply_rotary = sys.modules[type(inner).__module__].apply_rotary_pos_emb
        query, key, value = inner._split_heads(inner.query_key_value(hidden_states))
        batch, length = query.shape[:2]
        kv_heads = inner.num_heads if inner.new_decoder_architecture else inner.num_kv_heads
        query = query.transpose(1, 2).reshape(batch, inner.num_heads, length, inner.head_dim)
        key = key.transpose(1, 2).reshape(batch, kv_heads, length, inner.head_dim)
        value = value.transpose(1, 2).reshape(batch, kv_heads, length, inner.head_dim)
        if self.alibi_slopes is None:
            cos, sin = position_embeddings
            query, key = apply_rotary(query, key, cos, sin)
        out = self._attend(query, key, value, scaling=inner.head_dim ** -0.5)
        return inner.dense(out), None


class ScaledQueryAttentionPort(_Port):
    """Bart-style self-attention (XGLM, TrOCR, MVP): the query scaled before the product
    (so kvpage scales by 1). Cross-attention and MVP's prompts are not ported."""

    def forward(self, hidden_states: torch.Tensor, key_value_states=None, attention_mask=None, attn_prompt=None,
                **kwargs):
        inner = self.inner
        if key_value_states is not None or attn_prompt is not None:
            raise ValueError("cross-attention and attention prompts are not ported")  # refused before any step
        batch, length, _ = hidden_states.shape

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, length, -1, inner.head_dim).transpose(1, 2)

        query = heads(inner.q_proj(hidden_states) * inner.scaling)
        out = self._attend(query, heads(inner.k_proj(hidden_states)), heads(inner.v_proj(hidden_states)), scaling=1.0)
        return inner.out_proj(out), None


class OpenAIGPTAttentionPort(_Port):
    """The original GPT's attention (``Conv1D`` projections; scaled only when ``scale``).
    Its causal mask adds -1e4 where kvpage's excludes: equal once exp() underflows, as it
    does for any score within 1e4 of the row's largest."""

    def forward(self, x: torch.Tensor, attention_mask=None, output_attentions: bool = False):
        inner = self.inner
        query, key, value = (inner.split_heads(t) for t in inner.c_attn(x).split(inner.split_size, dim=2))
        head_dim = query.shape[-1]
        out = self._attend(query, key, value, scaling=head_dim ** -0.5 if inner.scale else 1.0)
        return [inner.resid_dropout(inner.c_proj(out))]


class BloomAttentionPort(_Port):
    """Bloom's attention: ALiBi, scores scaled by ``1/sqrt(head_dim)``; like the original it
    adds the residual (with dropout) itself."""

    def __init__(self, inner: nn.Module, layer_idx: int, config) -> None:
        super().__init__(inner, layer_idx, config)
        self.alibi_slopes = _bloom_slopes(inner, inner.num_heads)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor, alibi=None, attention_mask=None,
                layer_past=None, use_cache: bool = False, output_attentions: bool = False, **kwargs):
        inner = self.inner
        query, key, value = inner._reshape(inner.query_key_value(hidden_states))
        out = self._attend(query, key, value, scaling=inner.inv_norm_factor)
        dropout_add = sys.modules[type(inner).__module__].dropout_add
        return dropout_add(inner.dense(out), residual, inner.hidden_dropout, inner.training), None


class MptAttentionPort(_Port):
    """MPT's attention: ``softmax_scale``, optional ``clip_qkv``, ALiBi when configured."""

    def __init__(self, inner: nn.Module, layer_idx: int, config) -> None:
        super().__init__(inner, layer_idx, config)
        if config.attn_config.alibi:
            build = sys.modules[type(inner).__module__].build_mpt_alibi_tensor
            bias = build(inner.n_heads, 2, config.attn_config.alibi_bias_max)  # [heads, 1, 2]
            self.alibi_slopes = (bias[:, 0, 1] - bias[:, 0, 0]).float()

    def forward(self, hidden_states: torch.Tensor, position_bias=None, attention_mask=None, **kwargs):
        inner = self.inner
        batch, length = hidden_states.shape[:2]
        mixed = inner.Wqkv(hidden_states)
        if inner.clip_qkv:
            mixed = mixed.clamp(min=-inner.clip_qkv, max=inner.clip_qkv)
        query, key, value = (t.reshape(batch, length, inner.n_heads, inner.head_dim).transpose(1, 2)
                             for t in mixed.chunk(3, dim=2))
        out = self._attend(query, key, value, scaling=inner.softmax_scale)
        return inner.out_proj(out), None


def _bloom_slopes(inner: nn.Module, num_heads: int) -> torch.Tensor:
    """The heads' ALiBi slopes from the modeling file's own builder (Bloom's; Falcon reuses it):
    the bias it gives position 1 of a two-token sequence."""
    build = sys.modules[type(inner).__module__].build_alibi_tensor
    bias = build(torch.ones(1, 2), num_heads, torch.float32)  # [heads, 1, 2]
    return (bias[:, 0, 1] - bias[:, 0, 0]).float()


class BertSelfAttentionPort(_Port):
    """BERT-style self-attention of a decoder (``query``/``key``/``value`` projections,
    scaled by ``1/sqrt(head size)``); the caller's output block follows as before."""

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, encoder_hidden_states=None, **kwargs):
        inner = self.inner
        if encoder_hidden_states is not None:
            raise ValueError("cross-attention is not ported")  # such configs are refused before any step
        size = inner.attention_head_size

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(*hidden_states.shape[:-1], -1, size).transpose(1, 2)

        query, key, value = self._positioned(*(heads(proj(hidden_states))
                                               for proj in (inner.query, inner.key, inner.value)), **kwargs)
        return self._attend(query, key, value, scaling=size ** -0.5), None

    def _positioned(self, query, key, value, **kwargs):
        return query, key, value


class GitSelfAttentionPort(BertSelfAttentionPort):
    """GIT's text decoder: BERT-style self-attention, called with the cache where BERT has
    its encoder states (kvpage's forwards carry none). Text-only requests never run GIT's
    image encoder, whose tokens HF would let attend each other bidirectionally."""

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, cache=None, **kwargs):
        return super().forward(hidden_states, attention_mask, **kwargs)


class RoFormerSelfAttentionPort(BertSelfAttentionPort):
    """RoFormer's: the BERT-style attention with its sinusoidal rotary on Q and K (and V
    when ``rotary_value``), applied by the original's own helper. The table comes from the
    model's positional module, which kvpage hands the step's ``position_ids``
    (``position_relay``)."""

    def _positioned(self, query, key, value, sinusoidal_pos=None, **kwargs):
        if sinusoidal_pos is None:
            return query, key, value
        rotate = self.inner.apply_rotary_position_embeddings
        if self.inner.rotary_value:
            return rotate(sinusoidal_pos, query, key, value)
        return (*rotate(sinusoidal_pos, query, key), value)


class DogeAttentionPort(_Port):
    """Doge's attention with its dynamic mask: each key adds a bias of its own to every score
    it takes part in (``exp(A * softplus(dt_proj(value)))``, per KV head), which Doge builds
    into the mask it hands the interface. kvpage builds no mask; the port carries the bias in
    the key instead: ``[k, bias]`` against ``[q, 1/scaling]`` scores ``q.k * scaling + bias``
    (so the paged K of a Doge layer is one wider than its V). Doge keeps only the
    ``keep_window_size`` keys of highest bias once a sequence is longer than that; below it
    the mask is dense, and kvpage serves Doge up to that length
    (``families.exact_length_limit``)."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                **kwargs):
        inner = self.inner
        apply_rotary = sys.modules[type(inner).__module__].apply_rotary_pos_emb
        shape = (*hidden_states.shape[:-1], -1, inner.head_dim)
        query = inner.q_norm(inner.q_proj(hidden_states).view(shape)).transpose(1, 2)
        key = inner.k_norm(inner.k_proj(hidden_states).view(shape)).transpose(1, 2)
        value = inner.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary(query, key, cos, sin)
        rows = value.transpose(1, 2).reshape(value.shape[0], value.shape[2], -1)
        bias = torch.exp(inner.A * nn.functional.softplus(inner.dt_proj(rows))).transpose(1, 2)  # [B, H_kv, T]
        key = torch.cat((key, bias.unsqueeze(-1).to(key.dtype)), dim=-1)
        query = torch.cat((query, query.new_full((*query.shape[:-1], 1), 1.0 / inner.scaling)), dim=-1)
        out = self._attend(query, key, value, scaling=inner.scaling)
        return inner.o_proj(out), None


def dense_when_cached(model: nn.Module) -> Callable[[], None]:
    """BigBird's block-sparse pattern is bidirectional and writes no cache, so HF's BigBird
    decoder switches itself to dense (``original_full``) attention on its first forward with
    a cache, as every ``generate`` has. kvpage's forwards carry no HF cache, so the port makes
    that switch up front; returns the undo."""
    bert = model.bert
    before = bert.attention_type
    if before == "original_full":
        return lambda: None
    bert.set_attention_type("original_full")
    return lambda: bert.set_attention_type(before)


class PortSpec(NamedTuple):
    """Where a family's attention modules sit: ``layers`` (a dotted path from the causal-LM
    class ``model_class``) holds the decoder layers, ``attention`` (dotted, from a layer) the
    module the port replaces. Layer ``i`` of that list is layer ``i`` of the model. The
    registry (``families``) holds one per ported family."""

    model_class: str
    port: type
    layers: str
    attention: str
    #: Ported although the model can switch attention implementation: GIT's text attention
    #: is inline beside a vision tower on the interface; Doge's mask carries a bias of its
    #: own making.
    despite_interface: bool = False
    #: What else the family needs while kvpage owns the model: ``prepare(model)`` makes the
    #: change and returns its undo.
    prepare: Optional[Callable[[nn.Module], Callable[[], None]]] = None


def install_ports(model: nn.Module, spec: PortSpec) -> Callable[[], None]:
    """Swap ``spec``'s port in for each attention module of ``model`` (of class
    ``spec.model_class``); returns the function that puts the originals back."""
    parent_path, _, attribute = spec.attention.rpartition(".")
    undo_prepared = spec.prepare(model) if spec.prepare is not None else (lambda: None)
    swapped = []
    for layer, block in enumerate(operator.attrgetter(spec.layers)(model)):
        parent = operator.attrgetter(parent_path)(block) if parent_path else block
        original = getattr(parent, attribute)
        setattr(parent, attribute, spec.port(original, layer, model.config))
        swapped.append((parent, attribute, original))

    def undo() -> None:
        for parent, attribute, original in swapped:
            setattr(parent, attribute, original)
        undo_prepared()

    return undo


def alibi_slopes_by_layer(model: nn.Module) -> dict:
    """``{layer: float32 slopes [heads]}`` of the installed ports that use ALiBi."""
    return {m.layer_idx: m.alibi_slopes for m in model.modules() if isinstance(m, _Port) and m.alibi_slopes is not None}


def falcon_mask_alibi_slopes(model: nn.Module) -> dict:
    """``{layer: float32 slopes [heads]}`` of a Falcon whose attention is on the interface and
    folds ALiBi into the attention mask it builds, else ``{}`` (rotary Falcon). kvpage builds
    no mask, so the runner hands these slopes to the attention backend as it does a port's;
    scaled as the model scales its bias (by ``1/sqrt(head_dim)``, the scores' own scale)."""
    if not model.config.alibi:
        return {}
    slopes = {}
    for layer, block in enumerate(model.transformer.h):
        attention = block.self_attention
        slopes[layer] = _bloom_slopes(attention, attention.num_heads) * attention.inv_norm_factor
    return slopes
