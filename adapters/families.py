"""Model families' quirks: one record per family, the one place that names families.

Generic code (the runner's takeover of a model, its recurrent state, the engine builder)
looks a model's family up by its config's ``model_type`` (``family_of``) and acts on the
record's fields; no other module branches on a family. A family absent here has no quirk:
its attention goes through transformers' interface, its recurrent state (if any) lives in
transformers' ``Cache``, and kvpage serves it at any length. What kvpage finds by looking
at the loaded model rather than at its family (recurrent layers, DSA indexers, chunked or
shared attention) is not listed here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

from torch import nn

from .attention_ports import (BertSelfAttentionPort, BloomAttentionPort, DogeAttentionPort, FalconAttentionPort,
                              GitSelfAttentionPort, GPTNeoAttentionPort, GPTNeoXJapaneseAttentionPort,
                              MptAttentionPort, OpenAIGPTAttentionPort, PortSpec, RoFormerSelfAttentionPort,
                              ScaledQueryAttentionPort, dense_when_cached, falcon_mask_alibi_slopes)
from .state_carriers import CacheCarrier, MiniMaxCarrier, RecurrentGemmaCarrier, RwkvCarrier, StateCarrier


class ExactLengthLimit(NamedTuple):
    """The tokens up to which kvpage runs a model exactly."""

    tokens: int
    why: str  # a sentence ending in the limit
    bounds_steps: bool  # a step's rows count too, not only a sequence's length


@dataclass(frozen=True, slots=True)
class Family:
    """What one family needs beyond the generic path.

    port: where its attention modules sit and the port that replaces them
        (``attention_ports``), for releases whose attention is inline (or always, with
        ``despite_interface``).
    unserved_variant: ``(config) -> why`` its port cannot serve this variant, or None.
    mask_alibi: ``(model) -> {layer: slopes}`` for a family on the interface that folds ALiBi
        into the mask it builds; kvpage adds the slopes in its attention instead.
    state_carrier: ``(model) -> carrier`` where its forward keeps recurrent state, when not
        in transformers' cache layers (``state_carriers``).
    length_limit: ``(text config) -> limit`` up to which kvpage serves it exactly, or None.
    """

    port: Optional[PortSpec] = None
    unserved_variant: Optional[Callable[[Any], Optional[str]]] = None
    mask_alibi: Optional[Callable[[nn.Module], dict]] = None
    state_carrier: Optional[Callable[[nn.Module], StateCarrier]] = None
    length_limit: Optional[Callable[[Any], Optional[ExactLengthLimit]]] = None


def _bloom_variant(config) -> Optional[str]:
    if config.pretraining_tp > 1 and config.slow_but_exact:
        return "Bloom's slow_but_exact tensor-parallel slices (kvpage runs the output projection whole)"
    return None


def _mvp_variant(config) -> Optional[str]:
    if getattr(config, "use_prompt", False):
        return "MVP's attention prompts (kvpage's attention has no prompt keys)"
    return None


def _big_bird_variant(config) -> Optional[str]:
    # As a decoder, HF's BigBird itself attends densely whenever it has a cache (see
    # attention_ports.dense_when_cached); only the bidirectional encoder uses the block-sparse pattern.
    if config.attention_type != "original_full" and not config.is_decoder:
        return "BigBird's block-sparse attention outside a decoder (kvpage serves dense causal attention)"
    return None


def _temperature_tuning_limit(config) -> Optional[ExactLengthLimit]:
    """Llama 4's NoPE layers scale queries by ``log1p(floor((p + 1) / floor_scale))``,
    numbering positions from their own cache length, not ``position_ids``; in a kvpage step
    that is the row index. Below ``floor_scale - 1`` both give a scale of 1."""
    floor_scale = getattr(config, "floor_scale", None)
    if not getattr(config, "attn_temperature_tuning", False) or not floor_scale \
            or all(getattr(config, "no_rope_layers", None) or [True]):  # all rotary: nothing is tuned
        return None
    tokens = int(floor_scale) - 1
    return ExactLengthLimit(tokens, "this model's attention temperature tuning counts positions itself; kvpage "
                            f"serves it exactly up to {tokens} tokens (floor_scale - 1)", True)


def _keep_window_limit(config) -> Optional[ExactLengthLimit]:
    """Doge's dynamic mask keeps only the ``keep_window_size`` keys of highest bias once a
    sequence is longer than that (its port carries the bias, densely)."""
    if not getattr(config, "keep_window_size", None):
        return None
    tokens = int(config.keep_window_size)
    return ExactLengthLimit(tokens, "Doge's dynamic mask keeps only the keep_window_size keys of highest bias "
                            f"in longer sequences; kvpage serves it exactly up to {tokens} tokens", False)


def _ported(model_class: str, port: type, layers: str, attention: str, despite_interface: bool = False,
            prepare: Optional[Callable[[nn.Module], Callable[[], None]]] = None, **quirks: Any) -> Family:
    """A family served through a port (``PortSpec``'s fields), with its other quirks."""
    return Family(port=PortSpec(model_class, port, layers, attention, despite_interface, prepare), **quirks)


#: model_type -> the family's quirks.
FAMILIES: dict[str, Family] = {
    "gpt_neo": _ported("GPTNeoForCausalLM", GPTNeoAttentionPort, "transformer.h", "attn.attention"),
    "gpt_neox_japanese": _ported("GPTNeoXJapaneseForCausalLM", GPTNeoXJapaneseAttentionPort,
                                 "gpt_neox_japanese.layers", "attention"),
    "falcon": _ported("FalconForCausalLM", FalconAttentionPort, "transformer.h", "self_attention",
                      mask_alibi=falcon_mask_alibi_slopes),
    "xglm": _ported("XGLMForCausalLM", ScaledQueryAttentionPort, "model.layers", "self_attn"),
    "trocr": _ported("TrOCRForCausalLM", ScaledQueryAttentionPort, "model.decoder.layers", "self_attn"),
    "mvp": _ported("MvpForCausalLM", ScaledQueryAttentionPort, "model.decoder.layers", "self_attn",
                   unserved_variant=_mvp_variant),
    "rembert": _ported("RemBertForCausalLM", BertSelfAttentionPort, "rembert.encoder.layer", "attention.self"),
    "megatron-bert": _ported("MegatronBertForCausalLM", BertSelfAttentionPort, "bert.encoder.layer",
                             "attention.self"),
    "big_bird": _ported("BigBirdForCausalLM", BertSelfAttentionPort, "bert.encoder.layer", "attention.self",
                        prepare=dense_when_cached, unserved_variant=_big_bird_variant),
    "roformer": _ported("RoFormerForCausalLM", RoFormerSelfAttentionPort, "roformer.encoder.layer",
                        "attention.self"),
    "git": _ported("GitForCausalLM", GitSelfAttentionPort, "git.encoder.layer", "attention.self",
                   despite_interface=True),
    "doge": _ported("DogeForCausalLM", DogeAttentionPort, "model.layers", "self_attn", despite_interface=True,
                    length_limit=_keep_window_limit),
    "openai-gpt": _ported("OpenAIGPTLMHeadModel", OpenAIGPTAttentionPort, "transformer.h", "attn"),
    "bloom": _ported("BloomForCausalLM", BloomAttentionPort, "transformer.h", "self_attention",
                     unserved_variant=_bloom_variant),
    "mpt": _ported("MptForCausalLM", MptAttentionPort, "transformer.blocks", "attn"),
    "llama4_text": Family(length_limit=_temperature_tuning_limit),
    "minimax": Family(state_carrier=MiniMaxCarrier),
    "rwkv": Family(state_carrier=RwkvCarrier),
    "recurrent_gemma": Family(state_carrier=RecurrentGemmaCarrier),
}
#: The families served through attention ports, by model_type.
PORTS: dict[str, PortSpec] = {name: family.port for name, family in FAMILIES.items() if family.port is not None}
_NO_QUIRKS = Family()


def family_of(config) -> Family:
    """The quirks of ``config``'s family (none for a family not listed)."""
    return FAMILIES.get(getattr(config, "model_type", None), _NO_QUIRKS)


def port_of(model: nn.Module) -> Optional[PortSpec]:
    """The family's port when it fits ``model`` (the family's causal-LM class), else None."""
    spec = family_of(model.config).port
    return spec if spec is not None and type(model).__name__ == spec.model_class else None


def needs_port(model: nn.Module) -> bool:
    """Whether kvpage serves ``model`` through its family's port: the model cannot switch
    attention implementation (its attention is inline), or the family's spec says so."""
    spec = port_of(model)
    return spec is not None and (not type(model)._can_set_attn_implementation() or spec.despite_interface)


def port_refusal(model: nn.Module) -> Optional[str]:
    """Why the family's port cannot serve this model's variant, or None."""
    config = model.config
    unserved = family_of(config).unserved_variant
    why = unserved(config) if unserved is not None else None
    if why is None and getattr(config, "add_cross_attention", False):
        why = "cross-attention layers (kvpage serves decoder-only self-attention)"
    return None if why is None else f"its attention port does not serve this variant: {why}"


def mask_alibi_slopes(model: nn.Module) -> dict:
    """``{layer: float32 slopes [heads]}`` for a family on the interface that folds ALiBi into
    the attention mask it builds (``Family.mask_alibi``), else ``{}``."""
    fold = family_of(model.config).mask_alibi
    if fold is None or port_of(model) is None or not type(model)._can_set_attn_implementation():
        return {}
    return fold(model)


def carrier_of(model: nn.Module) -> StateCarrier:
    """The carrier of ``model``'s recurrent state: its family's, else transformers' cache."""
    family = family_of(model.config).state_carrier
    return family(model) if family is not None else CacheCarrier(model)


def exact_length_limit(model: nn.Module) -> Optional[ExactLengthLimit]:
    """The tokens up to which kvpage runs this model exactly, and why, or None when its
    length is not limited so (its text config's family sets the limit)."""
    config = model.config.get_text_config()
    limit = family_of(config).length_limit
    return limit(config) if limit is not None else None
