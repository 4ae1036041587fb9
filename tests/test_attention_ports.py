"""Families with inline attention run through attention ports (``adapters/attention_ports.py``).

Each tiny model comes from the census's generic config shrinker and runs the census's two
modes against HF ``generate`` (chunked prefill with prefix hits and preemption on a tiny
pool; whole prompts); Bloom, MPT and Falcon's ALiBi variant add ALiBi in kvpage's
attention. The ports leave the model as it was on ``restore()``.
"""
from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip("transformers")

from kvpage import LLM  # noqa: E402
from kvpage.adapters.attention_ports import PORTS  # noqa: E402
from kvpage.adapters.hf_runner import UnsupportedModelError  # noqa: E402
from kvpage.census.compare import census_prompts, compare_with_hf  # noqa: E402
from kvpage.census.tiny_config import tiny_config  # noqa: E402

FAMILIES = {
    "gpt_neo": (tf.GPTNeoConfig, tf.GPTNeoForCausalLM),
    "gpt_neox_japanese": (tf.GPTNeoXJapaneseConfig, tf.GPTNeoXJapaneseForCausalLM),
    "falcon": (tf.FalconConfig, tf.FalconForCausalLM),
    "xglm": (tf.XGLMConfig, tf.XGLMForCausalLM),
    "openai-gpt": (tf.OpenAIGPTConfig, tf.OpenAIGPTLMHeadModel),
    "bloom": (tf.BloomConfig, tf.BloomForCausalLM),
    "mpt": (tf.MptConfig, tf.MptForCausalLM),
    "trocr": (tf.TrOCRConfig, tf.TrOCRForCausalLM),
    "mvp": (tf.MvpConfig, tf.MvpForCausalLM),
    "rembert": (tf.RemBertConfig, tf.RemBertForCausalLM),
    "megatron-bert": (tf.MegatronBertConfig, tf.MegatronBertForCausalLM),
    "big_bird": (tf.BigBirdConfig, tf.BigBirdForCausalLM),
    "roformer": (tf.RoFormerConfig, tf.RoFormerForCausalLM),  # rotary from relayed positions
}
#: Settings a family's port needs that its defaults lack (BigBird's default is block-sparse).
NEEDS = {"big_bird": {"attention_type": "original_full"}}


def _model(family: str, **overrides):
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(0)
    config = tiny_config(config_class)
    for name, value in {**NEEDS.get(family, {}), **overrides}.items():
        setattr(config, name, value)
    return model_class._from_config(config, dtype=torch.float32).eval()


def test_every_port_is_tested():
    assert set(FAMILIES) == set(PORTS)


@pytest.mark.parametrize("family, overrides", [(family, {}) for family in FAMILIES] + [("falcon", {"alibi": True})])
def test_ported_family_matches_hf_in_both_census_modes(family, overrides):
    model = _model(family, **overrides)
    results = compare_with_hf(model, census_prompts(model.get_input_embeddings().weight.shape[0]), 8, 48)
    assert {mode: r.status for mode, r in results.items()} == {"stress": "exact", "plain": "exact"}, \
        {mode: r.difference for mode, r in results.items()}
    assert results["stress"].stats["preemptions"] > 0 and results["stress"].stats["prefix_cache_hits"] > 0


@pytest.mark.parametrize("family", ["gpt_neo", "falcon"])
def test_ports_are_swapped_in_and_out(family):
    model = _model(family)
    before = [type(m) for m in model.modules()]
    llm = LLM(model, block_size=4, num_kv_blocks=32, max_model_len=32)
    try:
        ported = [type(m).__name__ for m in model.modules() if type(m).__name__.endswith("AttentionPort")]
        assert len(ported) == model.config.num_hidden_layers
    finally:
        llm.restore()
    assert [type(m) for m in model.modules()] == before


@pytest.mark.parametrize("family, overrides, reason", [
    ("bloom", {"pretraining_tp": 2, "slow_but_exact": True}, "slow_but_exact"),
    ("big_bird", {"attention_type": "block_sparse"}, "block-sparse"),
    ("mvp", {"use_prompt": True}, "prompts"),
])
def test_variants_a_port_does_not_serve_are_refused(family, overrides, reason):
    model = _model(family, **overrides)
    with pytest.raises(UnsupportedModelError, match=reason):
        LLM(model, block_size=4, num_kv_blocks=32, max_model_len=32)
    assert not any(type(m).__name__.endswith("AttentionPort") for m in model.modules())


def test_a_composite_model_gets_its_text_config_switched_alone():
    """GOT-OCR2's SAM vision encoder computes attention inline, its Qwen2 text decoder goes
    through the interface: kvpage switches the text config alone (text-only requests never
    run the vision tower), exact in both census modes, and switches it back."""
    from kvpage.adapters.hf_runner import text_decoder_switchable
    from kvpage.census.family import _build_tiny_model

    model, problem = _build_tiny_model("got_ocr2", tf.GotOcr2ForConditionalGeneration)
    assert model is not None, problem
    assert not type(model)._can_set_attn_implementation() and text_decoder_switchable(model)
    before = model.config.text_config._attn_implementation
    results = compare_with_hf(model, census_prompts(model.get_input_embeddings().weight.shape[0]), 8, 48)
    assert {mode: r.status for mode, r in results.items()} == {"stress": "exact", "plain": "exact"}
    assert model.config.text_config._attn_implementation == before
