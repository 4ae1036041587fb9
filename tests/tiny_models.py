"""Tiny randomly initialised decoder models, one per supported family, built from configs.

Weights are drawn with a large ``initializer_range`` so greedy decoding has clear
winners: exact token equality against HF then tests kvpage, not float noise.
"""
from __future__ import annotations

import torch

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.15, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _census_tiny(config_class):
    from kvpage.tools.census.tiny_config import tiny_config

    return tiny_config(config_class)


def _configs() -> dict:
    import transformers as tf

    llama_like = dict(COMMON)
    mla = dict(COMMON, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
               qk_nope_head_dim=16, v_head_dim=8)
    return {
        "llama": lambda: tf.LlamaConfig(**llama_like),
        "mistral": lambda: tf.MistralConfig(**llama_like, sliding_window=8),
        "qwen2": lambda: tf.Qwen2Config(**llama_like),
        "qwen3": lambda: tf.Qwen3Config(**llama_like, head_dim=16),
        "phi3": lambda: tf.Phi3Config(**llama_like),
        "gemma": lambda: tf.GemmaConfig(**llama_like, head_dim=16),
        "gemma2": lambda: tf.Gemma2Config(**llama_like, head_dim=16, sliding_window=8,
                                          attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        "gemma3": lambda: tf.Gemma3TextConfig(**{**llama_like, "num_hidden_layers": 3}, head_dim=16,
                                              sliding_window=8, layer_types=["sliding_attention", "full_attention",
                                                                             "sliding_attention"]),
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                      initializer_range=0.15, bos_token_id=1, eos_token_id=2),
        "gpt_neox": lambda: tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             max_position_embeddings=256, initializer_range=0.15,
                                             bos_token_id=1, eos_token_id=2),
        "opt": lambda: tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64,
                                    init_std=0.15, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        # Extended matrix: sinks, MQA, MoE and other attention variants.
        "gpt_oss": lambda: tf.GptOssConfig(**llama_like, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
        "gpt_bigcode": lambda: tf.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                                   multi_query=True, initializer_range=0.15, bos_token_id=1,
                                                   eos_token_id=2),
        "gptj": lambda: tf.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, rotary_dim=8,
                                      initializer_range=0.15, bos_token_id=1, eos_token_id=2),
        "codegen": lambda: tf.CodeGenConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                            n_ctx=256, rotary_dim=8, initializer_range=0.15, bos_token_id=1,
                                            eos_token_id=2),
        "starcoder2": lambda: tf.Starcoder2Config(**llama_like, sliding_window=8),
        "phi": lambda: tf.PhiConfig(**llama_like),
        "mixtral": lambda: tf.MixtralConfig(**llama_like, num_local_experts=4),
        "olmo2": lambda: tf.Olmo2Config(**llama_like),
        "cohere": lambda: tf.CohereConfig(**llama_like),
        "granite": lambda: tf.GraniteConfig(**llama_like),
        "smollm3": lambda: tf.SmolLM3Config(**llama_like),
        # Per-layer KV layouts: MLA (V's head smaller than K's) and cross-layer KV sharing.
        "deepseek_v3": lambda: tf.DeepseekV3Config(**mla, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                                   topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1),
        "minicpm3": lambda: tf.MiniCPM3Config(**mla),
        # Differential attention: two attention calls per layer, each with its own half of V.
        "diffllama": lambda: tf.DiffLlamaConfig(**llama_like),
        "gemma3n_text": lambda: tf.Gemma3nTextConfig(
            **{**llama_like, "num_hidden_layers": 4, "intermediate_size": [96] * 4}, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
            vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, laurel_rank=8,
            activation_sparsity_pattern=[0.0] * 4),
        # Decoders that number positions themselves (position_relay): learned with an offset, sinusoidal.
        "bart": lambda: tf.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                      decoder_attention_heads=4, decoder_ffn_dim=96, max_position_embeddings=256,
                                      init_std=0.15, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      forced_eos_token_id=2),
        "pegasus": lambda: tf.PegasusConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                            decoder_attention_heads=4, decoder_ffn_dim=96,
                                            max_position_embeddings=256, init_std=0.15, pad_token_id=0,
                                            eos_token_id=1),
        # Not supported: attention bypasses the interface, or there is no attention at all.
        "xlnet": lambda: _census_tiny(tf.XLNetConfig),
        "stablelm": lambda: tf.StableLmConfig(**llama_like),
        "nemotron": lambda: tf.NemotronConfig(**{**llama_like, "hidden_act": "relu2"}, partial_rotary_factor=0.5),
        # Recurrent state (state-space mixers, gated delta nets) in state slots beside the paged KV.
        "mamba": lambda: tf.MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8,
                                        initializer_range=0.15, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "jamba": lambda: tf.JambaConfig(**{**llama_like, "num_hidden_layers": 3}, attn_layer_period=3,
                                        attn_layer_offset=1, expert_layer_period=3, num_experts=2,
                                        mamba_d_state=8),
        "qwen3_next": lambda: tf.Qwen3NextConfig(**llama_like, head_dim=16, linear_num_key_heads=2,
                                                 linear_num_value_heads=4, linear_key_head_dim=16,
                                                 linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                 layer_types=["linear_attention", "full_attention"]),
        # State outside transformers' cache layers (adapters/state_carriers): MiniMax's own
        # cache class beside full attention; RWKV's state list, no attention at all.
        "minimax": lambda: _census_tiny(tf.MiniMaxConfig),
        "rwkv": lambda: _census_tiny(tf.RwkvConfig),
        "recurrent_gemma": lambda: _census_tiny(tf.RecurrentGemmaConfig),  # state on its blocks
    }


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "gpt2", "gpt_neox", "opt"]
EXTENDED_FAMILIES = ["gpt_oss", "gpt_bigcode", "gptj", "codegen", "starcoder2", "phi", "mixtral", "olmo2", "cohere",
                     "granite", "smollm3", "stablelm", "nemotron", "deepseek_v3", "minicpm3", "gemma3n_text",
                     "diffllama", "bart", "pegasus"]
RECURRENT_FAMILIES = ["mamba", "jamba", "qwen3_next", "minimax", "rwkv", "recurrent_gemma"]
UNSUPPORTED_FAMILIES = ["xlnet"]


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A fresh, eval-mode, randomly initialised causal LM of ``family``."""
    from transformers import AutoModelForCausalLM

    config = _configs()[family]()
    if family not in UNSUPPORTED_FAMILIES and family not in ("mamba", "rwkv"):
        config._attn_implementation = "eager" if family in ("gemma2", "gpt_oss") else "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def kv_groups_of(model) -> int:
    """KV groups the engine gives ``model`` (more than one for hybrid sliding-window models).

    With hybrid groups a pool block holds one group's layers, not every layer's, so tests
    that size a pool in blocks scale it by this to keep the same bytes.
    """
    from kvpage.adapters.config_spec import kv_spec_from_config

    try:
        return kv_spec_from_config(model.config, 4, "float32").kv_groups().num_groups
    except ValueError:  # KV shared across layers: only a probe of the loaded model plans it
        from kvpage.adapters.hf_runner import HFModelRunner
        from kvpage.storage.spec import KVCacheSpec

        runner = HFModelRunner(model)
        try:
            return KVCacheSpec(tuple(runner.layer_specs), 4, "float32").kv_groups().num_groups
        finally:
            runner.restore()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF ``generate`` greedy continuation of one unpadded prompt, ignoring EOS (and the
    generation config's forced first/last tokens: plain greedy, as kvpage serves it)."""
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, forced_eos_token_id=None, forced_bos_token_id=None)
    return out[0, len(prompt):].tolist()


def char_tokenizer():
    """A character-level fast tokenizer over ``VOCAB`` ids: 0 pad, 1 bos, 2 eos, then ASCII 32.."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 32 + VOCAB - 3)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{ch: i + 3 for i, ch in enumerate(chars)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
