"""The model under test: a seeded random Llama-shaped model, or any model ``LLM`` can load.

Random models are built from a config (no download); sizes in ``RANDOM_SIZES`` are
hidden size, layers, heads, KV heads, MLP width and vocabulary. ``random-gemma3`` is a
Gemma3 text model with the Gemma3 layer pattern (five sliding-window layers of
``GEMMA3_WINDOW`` tokens, then one full-attention layer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RANDOM_SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab) ~ parameter count
    "random-tiny": (64, 2, 4, 2, 96, 96),  # ~0.1M, for tests
    "random-30m": (512, 6, 8, 4, 1408, 8192),  # ~26M
    "random-50m": (640, 8, 10, 5, 1728, 8192),  # ~44M
    "random-350m": (1024, 20, 16, 8, 2816, 32000),  # ~0.36B, the GPU ("full") default
    "random-gemma3": (512, 6, 8, 4, 1408, 8192),  # ~26M, Gemma3 pattern (long-context scenario)
}
GEMMA3_WINDOW = 128


@dataclass
class LoadedModel:
    """A model in eval mode, its name, vocabulary size and KV bytes per token (all layers, K+V)."""

    name: str
    model: Any
    vocab_size: int
    kv_bytes_per_token: int

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def kv_bytes_per_token(model: Any) -> int:
    """Bytes one token's K and V take over all layers, in the model's dtype."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize


def random_model(name: str, seed: int, device: str, max_positions: int = 8192) -> Any:
    """A freshly initialised causal LM of size ``name`` (a key of ``RANDOM_SIZES``): Llama, or
    Gemma3 for ``random-gemma3``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    hidden, layers, heads, kv_heads, inter, vocab = RANDOM_SIZES[name]
    sizes = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "random-gemma3":
        from transformers import Gemma3TextConfig

        config = Gemma3TextConfig(**sizes, head_dim=hidden // heads, sliding_window=GEMMA3_WINDOW,
                                  layer_types=[("full" if (i + 1) % 6 == 0 else "sliding") + "_attention"
                                               for i in range(layers)])
    else:
        config = LlamaConfig(**sizes)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def load(name: str, seed: int, device: str) -> LoadedModel:
    """``name`` is a key of ``RANDOM_SIZES``, a local HF folder or a kvpage alias (``smollm2-135m``)."""
    if name in RANDOM_SIZES:
        model = random_model(name, seed, device)
    else:
        from kvpage.engine.builder import load_model
        from kvpage.core.config import EngineConfig

        model, _, _ = load_model(name, None, EngineConfig(device=device))
        if model.config._attn_implementation not in ("sdpa", "eager"):
            model.set_attn_implementation("sdpa")
    vocab = int(model.get_input_embeddings().weight.shape[0])
    return LoadedModel(name, model, vocab, kv_bytes_per_token(model))
