"""A tiny random config for any transformers model family, by shrinking its config class's defaults.

Generic, not per family: every dataclass field of the config class is looked at by name
(hidden sizes, FFN sizes, layers, heads and KV heads, head sizes, MLA ranks, vocabulary,
positions, experts, windows, state-space sizes, ...) and its default replaced by a small
value that keeps the usual ratios (MHA stays MHA, MQA stays MQA, MLA's V head stays
smaller than K's). Sub-configs (``text_config``, ``vision_config``, ...) are shrunk the
same way, recursively.

Layers: the tiny model keeps one layer of each distinct kind in the original's layer
pattern (``layer_types`` and friends), cycled ``repeats`` times in the original's order, so
a hybrid stays hybrid, a sliding/full pattern keeps both kinds, and with ``repeats=2``
KV-sharing and weight-tying patterns find a second layer of each kind. A pattern stored in
a field is cut down to the kept layers (with every list as long as the layer count); one
computed by the config (a property) is kept as a prefix long enough to hold every kind.

``candidate_overrides`` also yields relaxed variants (one override left at its default)
for configs whose validators reject a value: the caller keeps the first variant HF can
build and run.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

VOCAB = 128
HIDDEN = 64
HEADS = 4
HEAD_DIM = 16
FFN = 96
POSITIONS = 256
WINDOW = 8
INIT_RANGE = 0.15  # large weights give clear greedy winners, so exactness tests kvpage, not float noise

_HIDDEN = {"hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "word_embed_proj_dim", "model_dim",
           "emb_dim", "embedding_size", "dim", "output_embedding_size", "lru_width", "backbone_hidden_size",
           "projection_dim"}
_FFN = {"intermediate_size", "ffn_dim", "n_inner", "d_ff", "dim_ff", "ffn_hidden_size", "moe_intermediate_size",
        "shared_expert_intermediate_size", "decoder_ffn_dim", "encoder_ffn_dim", "dff", "inner_hidden_size",
        "moe_shared_expert_intermediate_size", "expert_intermediate_size", "shared_intermediate_size",
        "ffn_hidden_dim", "mlp_dim", "intermediate_dim", "moe_ffn_hidden_size", "router_hidden_size",
        "expert_ffn_hidden_size", "intermediate_size_mlp", "dense_intermediate_size", "d_inner", "feed_forward_size"}
_LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")
_ALSO_LAYERS = {"encoder_layers"}
_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads", "attention_heads")
_ALSO_HEADS = {"encoder_attention_heads"}
_KV_HEADS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_query_groups",
             "kv_n_heads", "n_head_kv", "num_kv_groups"}
_HEAD_DIM = {"head_dim", "attention_head_dim", "kv_channels", "dim_head", "d_head", "d_kv", "attention_head_size",
             "head_size", "index_head_dim", "linear_key_head_dim", "linear_value_head_dim", "mamba_d_head",
             "mamba_headdim", "linear_head_dim", "swa_head_dim"}
_FIXED = {  # name -> small value, for positive int defaults
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "o_lora_rank": 16,
    "rotary_dim": 8, "rope_dim": 8,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_k": 2, "num_experts_per_token": 2, "moe_topk": 2, "router_top_k": 2,
    "top_k": 2, "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    # A DSA indexer scores a key by the ReLU dot products of its heads; with only a few heads,
    # many keys score exactly 0 (all heads negative), which checkpoints (64 heads) never see,
    # and at such ties HF's picks for a prompt token depend on the prompt's length, so two
    # prompts sharing a prefix pick differently on it (which a prefix cache cannot follow).
    "index_n_heads": 16, "index_topk": 4,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_num_heads": 4,
    "mamba_d_state": 8, "state_size": 8, "ssm_state_size": 8, "mamba_n_heads": 4, "n_mamba_heads": 4,
    "mamba_chunk_size": 8, "chunk_size": 8, "time_step_rank": 8, "mamba_dt_rank": 8, "mamba_d_ssm": 64,
    "mamba_n_groups": 1, "n_groups": 1, "laurel_rank": 8, "hidden_size_per_layer_input": 8,
    "adapter_rank": 8, "attention_hidden_size": 2 * HIDDEN, "num_key_heads": 2, "num_value_heads": 4,
    "block_size": 4, "patch_size": 4, "image_size": 16, "num_codebooks": 2, "codebook_size": 32,
    "gated_norm_rank": 8, "num_centroids": 8, "centroid_intermediate_top_k": 2,
}
_AT_MOST = {"n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1, "first_k_dense_replace": 1}
_WHEN_NONE = {"head_dim": HEAD_DIM, "num_experts_per_tok": 2, "n_routed_experts": 4, "n_shared_experts": 1,
              "num_key_value_heads": HEADS}  # None defaults that the models cannot run with
# Doge's keep_window_size is the length up to which its dynamic mask is dense (beyond it a
# top-k over key biases, which kvpage does not serve): it shrinks with the positions, as in
# Doge's own configs, so the census runs the dense mask kvpage serves.
_POSITIONS = {"max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "max_sequence_length",
              "model_max_length", "max_window_layers", "max_target_positions", "keep_window_size"}
_WINDOWS = {"sliding_window", "attention_chunk_size", "window_size", "local_attention_window", "attention_window",
            "local_attention_window_len", "swa_window", "sliding_window_size", "attention_window_size"}
_INIT = {"initializer_range", "init_std"}
_SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_PATTERNS = ("layer_types", "layers_block_type", "block_types")
# Fields of (n_heads, head_dim, expand) that state-space validators tie to hidden_size.
_SSM_TRIPLES = (("mamba_n_heads", "mamba_d_head", "mamba_expand"), ("num_heads", "head_dim", "expand"),
                ("n_mamba_heads", "mamba_headdim", "mamba_expand"))


def tiny_config(config_class: type, repeats: int = 1, min_layers: int = 2) -> Any:
    """An instance of ``config_class`` with every size shrunk (see the module docstring)."""
    return config_class(**tiny_overrides(config_class, repeats, min_layers))


def candidate_overrides(config_class: type, repeats: int = 1) -> Iterator[dict]:
    """The full overrides, then each variant that leaves one override at its default."""
    full = tiny_overrides(config_class, repeats)
    yield full
    for name in full:
        if name not in _LAYERS and name not in ("vocab_size", "hidden_size"):
            yield {k: v for k, v in full.items() if k != name}


def tiny_overrides(config_class: type, repeats: int = 1, min_layers: int = 2) -> dict:
    """The keyword arguments ``tiny_config`` passes to ``config_class``."""
    default = config_class()
    fields = {f.name: f for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else {}
    values = {name: _read(default, name) for name in (fields or default.to_dict())}
    overrides: dict = {}
    for name, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        sub = values.get(name)
        if sub is not None and hasattr(sub, "to_dict") and dataclasses.is_dataclass(type(sub)):
            overrides[name] = tiny_overrides(type(sub), repeats, min_layers)
    plan = _layer_plan(default, values, fields, repeats, min_layers)
    heads = _first_int(values, _HEADS)
    hidden = _first_int(values, sorted(_HIDDEN))
    for name, value in values.items():
        if name in overrides or hasattr(value, "to_dict"):
            continue
        class_default = fields[name].default if name in fields else value
        new = _shrunk(name, value, class_default, plan, heads, hidden)
        if new is not _KEEP:
            overrides[name] = new
    _keep_consistent(values, overrides)
    return overrides


def _read(config: Any, name: str) -> Any:
    try:  # some configs refuse to read per-layer attributes globally
        return getattr(config, name)
    except Exception:  # noqa: BLE001
        return config.to_dict().get(name)


_KEEP = object()


@dataclasses.dataclass
class _LayerPlan:
    original: int  # layers in the default config
    count: int  # layers in the tiny one
    kept: Optional[list]  # original indices kept (None: a prefix of ``count`` layers)


def _layer_plan(default: Any, values: dict, fields: dict, repeats: int, min_layers: int) -> Optional[_LayerPlan]:
    original = _first_int(values, _LAYERS)
    if original is None:
        return None
    attribute_map = getattr(type(default), "attribute_map", {}) or {}
    for name in _PATTERNS:
        pattern = _read(default, name)
        if isinstance(pattern, (list, tuple)) and len(pattern) == original:
            picks = _cycle_kinds([str(kind) for kind in pattern], repeats)
            picks += [i for i in range(original) if i not in picks][: max(0, min_layers - len(picks))]
            picks.sort()
            if attribute_map.get(name, name) in fields:
                return _LayerPlan(original, len(picks), picks)
            return _LayerPlan(original, max(picks) + 1, None)  # computed pattern: keep a prefix
    return _LayerPlan(original, min(original, max(min_layers, repeats)), None)


def _cycle_kinds(pattern: list, repeats: int) -> list:
    """Indices that visit every kind in first-seen order, ``repeats`` times, each after the last."""
    order = list(dict.fromkeys(pattern))
    picks: list = []
    last = -1
    for _ in range(repeats):
        for kind in order:
            following = [i for i in range(last + 1, len(pattern)) if pattern[i] == kind]
            if following:
                picks.append(following[0])
                last = following[0]
    return picks


def _first_int(values: dict, names) -> Optional[int]:
    for name in names:
        value = values.get(name)
        if _is_int(value) and value > 0:
            return value
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrunk(name: str, value: Any, class_default: Any, plan: Optional[_LayerPlan], heads: Optional[int],
            hidden_default: Optional[int] = None) -> Any:
    """The tiny value of field ``name`` (``_KEEP`` to leave the default alone)."""
    if isinstance(value, (list, tuple)) and plan is not None and len(value) == plan.original and value:
        kept = plan.kept if plan.kept is not None else range(plan.count)
        return [FFN if name in _FFN and _is_int(value[i]) else value[i] for i in kept]  # one entry per kept layer
    if _is_split_of(value, hidden_default):  # parts of the hidden size (Reformer's axial embedding dims)
        return [HIDDEN * part // hidden_default for part in value]
    if isinstance(value, (list, tuple)) and plan is not None and _is_repeat_spec(value, plan.original):
        kinds = value[0][0]
        return [[kinds, max(1, plan.count // len(kinds))]]  # [[kinds, n]]: n repeats of the kinds
    if name in _SPECIAL_IDS and value is not None:
        return _SPECIAL_IDS[name]
    if name in _INIT and isinstance(value, float):
        return INIT_RANGE
    if name == "is_decoder" and value is False:
        return True  # causal-LM heads of encoder-style models generate only as decoders
    if value is None and name in _WHEN_NONE:
        return _WHEN_NONE[name]
    if name == "rope_parameters" and value == {}:
        return {"rope_type": "default", "rope_theta": 10000.0}  # a default that names no RoPE at all
    if not _is_int(value) or value <= 0 or class_default is None:
        return _KEEP
    return _shrunk_int(name, value, plan, heads)


def _shrunk_int(name: str, value: int, plan: Optional[_LayerPlan], heads: Optional[int]) -> Any:
    if name in _LAYERS or name in _ALSO_LAYERS:
        return plan.count if plan is not None else 2
    if name in _HIDDEN:
        return HIDDEN
    if name in _FFN:
        return FFN
    if name in _HEADS or name in _ALSO_HEADS:
        return HEADS
    if name in _KV_HEADS:
        return HEADS if heads and value == heads else (1 if value == 1 else 2)
    if name in _HEAD_DIM:
        return HEAD_DIM
    if name in _POSITIONS:
        return POSITIONS
    if name in _WINDOWS:
        return WINDOW
    if name in _FIXED:
        return _FIXED[name]
    if name in _AT_MOST:
        return min(value, _AT_MOST[name])
    if "vocab" in name and value > VOCAB:
        return VOCAB
    if name.endswith(("token_id", "token_index")) and value >= VOCAB:
        return VOCAB - 1 - sum(map(ord, name)) % 16  # in the vocabulary, away from the ids prompts use
    if name == "num_kv_shared_layers" and plan is not None:
        kinds = plan.count if plan.kept is None else len({*plan.kept})
        return min(value, max(0, kinds // 2))
    return _KEEP


def _is_split_of(value: Any, total: Optional[int]) -> bool:
    """A list of two or more positive ints that sum to ``total`` and shrink to whole parts."""
    return (isinstance(value, (list, tuple)) and len(value) > 1 and bool(total) and all(_is_int(v) and v > 0 for v in value)
            and sum(value) == total and all(HIDDEN * v % total == 0 for v in value))


def _is_repeat_spec(value: Any, layers: int) -> bool:
    """``[[kinds, n], ...]`` describing ``layers`` layers (GPT-Neo's ``attention_types``)."""
    try:
        return len(value) == 1 and sum(len(kinds) * int(n) for kinds, n in value) == layers
    except (TypeError, ValueError):
        return False


def _keep_consistent(values: dict, overrides: dict) -> None:
    """Ratios that config validators or models tie together."""
    if "qk_rope_head_dim" in overrides:  # MLA
        if _is_int(values.get("v_head_dim")):
            overrides["v_head_dim"] = 8
        if _is_int(values.get("qk_head_dim")):
            overrides["qk_head_dim"] = overrides.get("qk_nope_head_dim", 16) + overrides["qk_rope_head_dim"]
        if values.get("head_dim") == values.get("qk_rope_head_dim"):
            overrides["head_dim"] = overrides["qk_rope_head_dim"]  # models that size RoPE by head_dim
    for heads_name, dim_name, expand_name in _SSM_TRIPLES:
        expand = values.get(expand_name)
        if _is_int(expand) and heads_name in overrides and dim_name in overrides:
            inner = overrides.get("mamba_d_ssm") or expand * overrides.get("hidden_size", HIDDEN)
            overrides[heads_name] = inner // overrides[dim_name]
