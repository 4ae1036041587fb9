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
from kvpage.adapters.families import PORTS  # noqa: E402
from kvpage.adapters.hf_runner import UnsupportedModelError  # noqa: E402
from kvpage.tools.census.compare import census_prompts, compare_with_hf  # noqa: E402
from kvpage.tools.census.tiny_config import tiny_config  # noqa: E402

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
    "git": (tf.GitConfig, tf.GitForCausalLM),  # text-only requests: its image encoder never runs
    "doge": (tf.DogeConfig, tf.DogeForCausalLM),  # its key bias rides in K (and see the test below)
}
#: Settings a family's port needs that its defaults lack.
NEEDS: dict = {}


def _model(family: str, **overrides):
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(0)
    config = tiny_config(config_class)
    for name, value in {**NEEDS.get(family, {}), **overrides}.items():
        setattr(config, name, value)
    return model_class._from_config(config, dtype=torch.float32).eval()


def test_every_port_is_tested():
    assert set(FAMILIES) == set(PORTS)


@pytest.mark.parametrize("family, overrides", [(family, {}) for family in FAMILIES] + [
    ("falcon", {"alibi": True}), ("big_bird", {"attention_type": "original_full"})])
def test_ported_family_matches_hf_in_both_census_modes(family, overrides):
    model = _model(family, **overrides)
    results = compare_with_hf(model, census_prompts(model.get_input_embeddings().weight.shape[0]), 8, 48)
    assert {mode: r.status for mode, r in results.items()} == {"stress": "exact", "plain": "exact"}, \
        {mode: r.difference for mode, r in results.items()}
    assert results["stress"].stats["preemptions"] > 0 and results["stress"].stats["prefix_cache_hits"] > 0


@pytest.mark.parametrize("family", ["gpt_neo", "falcon", "big_bird"])
def test_ports_are_swapped_in_and_out(family):
    """Ports in while kvpage owns the model, the originals back after; BigBird's
    block-sparse decoder runs dense meanwhile (as HF's does with a cache) and gets its
    setting back."""
    model = _model(family)
    if type(model)._can_set_attn_implementation():
        pytest.skip(f"{family}'s attention goes through the interface in this transformers; no port is installed")
    before = [type(m) for m in model.modules()]
    attention_types = [m.attention_type for m in model.modules() if hasattr(m, "attention_type")]
    llm = LLM(model, block_size=4, num_kv_blocks=32, max_model_len=32)
    try:
        ported = [type(m).__name__ for m in model.modules() if type(m).__name__.endswith("AttentionPort")]
        assert len(ported) == model.config.num_hidden_layers
        if family == "big_bird":
            assert "block_sparse" in attention_types
            assert {m.attention_type for m in model.modules() if hasattr(m, "attention_type")} == {"original_full"}
    finally:
        llm.restore()
    assert [type(m) for m in model.modules()] == before
    assert [m.attention_type for m in model.modules() if hasattr(m, "attention_type")] == attention_types


def test_falcon_on_the_interface_gets_no_port_and_its_alibi_from_kvpage(caplog):
    """Falcon's attention moved onto the interface, its ALiBi into the mask it builds: kvpage
    installs no port, hands the model a placeholder mask to fold ALiBi into, adds the slopes
    in its own attention (exact in both modes, above), and says why that variant runs eager."""
    model = _model("falcon", alibi=True)
    if not type(model)._can_set_attn_implementation():
        pytest.skip("this transformers' Falcon computes attention inline (its port serves it)")
    import logging

    with caplog.at_level(logging.INFO, logger="kvpage"):
        llm = LLM(model, block_size=4, num_kv_blocks=32, max_model_len=32, enforce_eager=False)
    try:
        runner = llm.engine.runner
        assert not any(type(m).__name__.endswith("AttentionPort") for m in model.modules())
        assert runner.uses_alibi and runner.eager_reason is not None and "ALiBi" in runner.eager_reason
        assert runner.compiled is None
        assert any("compilation off" in r.getMessage() and "ALiBi" in r.getMessage() for r in caplog.records)
        slopes = [site.alibi_slopes for site in runner.sites if site.alibi_slopes is not None]
        assert len(slopes) == model.config.num_hidden_layers
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        heads = model.config.num_attention_heads
        expected = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]) * head_dim ** -0.5
        torch.testing.assert_close(slopes[0], expected)
    finally:
        llm.restore()
    rotary = _model("falcon")
    llm = LLM(rotary, block_size=4, num_kv_blocks=32, max_model_len=32, enforce_eager=True)
    try:
        assert not llm.engine.runner.uses_alibi and llm.engine.runner.eager_reason is None
    finally:
        llm.restore()


def test_doge_key_bias_is_served_exactly_up_to_keep_window_size():
    """Doge's dynamic mask adds a per-key bias (``exp(A * softplus(dt_proj(v)))``); its ``A``
    starts at zero, where the bias is the same for every key and changes nothing, so this
    draws ``A`` at random: the bias then moves HF's logits, and kvpage still matches HF in
    both census modes. Past ``keep_window_size`` Doge keeps a top-k of keys: kvpage caps
    ``max_model_len`` there and refuses a longer one."""
    model = _model("doge")
    prompt = torch.tensor([census_prompts(128)[5]])
    with torch.inference_mode():
        flat = model(prompt).logits
        for layer in model.model.layers:
            layer.self_attn.A.normal_(0.0, 1.0)
        biased = model(prompt).logits
    assert (flat - biased).abs().max() > 1e-2
    results = compare_with_hf(model, census_prompts(128), 8, 48)
    assert {mode: r.status for mode, r in results.items()} == {"stress": "exact", "plain": "exact"}, \
        {mode: r.difference for mode, r in results.items()}

    model.config.keep_window_size = 24
    with pytest.raises(ValueError, match="up to 24 tokens"):
        LLM(model, block_size=4, num_kv_blocks=64, max_model_len=32)
    llm = LLM(model, block_size=4, num_kv_blocks=64)
    try:
        assert llm.max_model_len == 24
        key_spec = llm.engine.runner.layer_specs[0]
        assert key_spec.k_head_dim == key_spec.v_head_dim + 1  # the bias column
    finally:
        llm.restore()


@pytest.mark.parametrize("family, overrides, reason", [
    ("bloom", {"pretraining_tp": 2, "slow_but_exact": True}, "slow_but_exact"),
    ("big_bird", {"attention_type": "block_sparse", "is_decoder": False}, "block-sparse"),
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
    from kvpage.tools.census.family import _build_tiny_model

    model, problem = _build_tiny_model("got_ocr2", tf.GotOcr2ForConditionalGeneration)
    assert model is not None, problem
    assert not type(model)._can_set_attn_implementation() and text_decoder_switchable(model)
    before = model.config.text_config._attn_implementation
    results = compare_with_hf(model, census_prompts(model.get_input_embeddings().weight.shape[0]), 8, 48)
    assert {mode: r.status for mode, r in results.items()} == {"stress": "exact", "plain": "exact"}
    assert model.config.text_config._attn_implementation == before
