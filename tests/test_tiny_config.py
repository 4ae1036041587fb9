"""The census's generic config shrinker: small sizes, ratios kept, layer patterns kept."""
from __future__ import annotations

import pytest

tf = pytest.importorskip("transformers")

from kvpage.tools.census.tiny_config import HIDDEN, VOCAB, candidate_overrides, tiny_config  # noqa: E402


def test_llama_shrinks_every_size_and_keeps_mha():
    config = tiny_config(tf.LlamaConfig)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (HIDDEN, 2, VOCAB)
    assert config.num_attention_heads == config.num_key_value_heads == 4  # the default is MHA
    assert config.intermediate_size < 128 and config.max_position_embeddings <= 256
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)  # in the vocabulary; pad stays None


def test_gqa_and_mqa_ratios_survive():
    assert tiny_config(tf.MistralConfig).num_key_value_heads == 2  # 32 / 8 stays grouped
    assert tiny_config(tf.GPTBigCodeConfig).multi_query  # MQA stays MQA


def test_layer_pattern_keeps_one_layer_of_each_kind_in_order():
    config = tiny_config(tf.Gemma3TextConfig)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert config.sliding_window <= 8
    twice = tiny_config(tf.Gemma3TextConfig, repeats=2)
    assert twice.layer_types == ["sliding_attention", "full_attention"] * 2


def test_computed_pattern_keeps_a_prefix_with_every_kind():
    config = tiny_config(tf.JambaConfig)  # attention every 8th layer from 4: computed, not stored
    assert "full_attention" in config.layer_types and "linear_attention" in config.layer_types


def test_mla_keeps_v_head_smaller_than_k_head():
    config = tiny_config(tf.DeepseekV3Config)
    assert config.v_head_dim < config.qk_nope_head_dim + config.qk_rope_head_dim
    assert config.n_routed_experts <= 4 and config.num_experts_per_tok <= 2


def test_sub_configs_are_shrunk_too():
    config = tiny_config(tf.Gemma3Config)
    assert config.text_config.hidden_size == HIDDEN and config.text_config.vocab_size == VOCAB
    assert config.vision_config.hidden_size == HIDDEN


def test_relaxed_variants_leave_one_override_at_its_default():
    variants = list(candidate_overrides(tf.LlamaConfig))
    full = variants[0]
    assert all(len(v) == len(full) - 1 for v in variants[1:])
    assert all("num_hidden_layers" in v for v in variants)
