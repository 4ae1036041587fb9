"""The model under test: a seeded random Llama-shaped model, or any model ``LLM`` can load.

Random models are built from a config (no download); sizes in ``RANDOM_SIZES`` are
hidden size, layers, heads, KV heads, MLP width and vocabulary, and ``RANDOM_EXTRAS``
holds a size's other config fields. ``random-llama3-8b`` has Llama-3-8B's shape (8.03B
parameters, 128 KiB of bf16 KV per token). ``random-gemma3`` is a Gemma3 text model with
the Gemma3 layer pattern (five sliding-window layers of ``GEMMA3_WINDOW`` tokens, then one
full-attention layer).

A random model is built where it runs: its parameters are created and initialised on the
target device in the target dtype (``torch.device`` as the default device), never on the
host first, so an 8B model is ready in seconds on a GPU; ``device="meta"`` builds the shape
alone (for counting parameters and KV bytes without memory).
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
    "random-llama3-8b": (4096, 32, 32, 8, 14336, 128256),  # 8.03B, Llama-3-8B's shape (GPU only)
    "random-gemma3": (512, 6, 8, 4, 1408, 8192),  # ~26M, Gemma3 pattern (long-context scenario)
}
#: Config fields besides the sizes, per random model (``max_position_embeddings`` is the
#: ``max_positions`` argument of ``random_model``).
RANDOM_EXTRAS = {"random-llama3-8b": {"rope_theta": 500000.0}}
GEMMA3_WINDOW = 128
#: ``dtype="auto"``: fp32 on the CPU (its fastest exact path), bf16 on any other device.
DTYPES = ("auto", "float32", "bfloat16", "float16")


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


def resolve_dtype(dtype: str, device: str) -> Any:
    """The torch dtype a random model is built in: ``dtype`` (one of ``DTYPES``), where
    ``"auto"`` is float32 on ``"cpu"`` and bfloat16 elsewhere (``"cuda"``, ``"meta"``)."""
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return getattr(torch, dtype)


def random_config(name: str, max_positions: int = 8192) -> Any:
    """The HF config of random model ``name`` (a key of ``RANDOM_SIZES``): Llama, or Gemma3
    for ``random-gemma3``; ``ValueError`` for other names."""
    from transformers import LlamaConfig

    if name not in RANDOM_SIZES:
        raise ValueError(f"unknown random model {name!r}; choose from {', '.join(RANDOM_SIZES)}")
    hidden, layers, heads, kv_heads, inter, vocab = RANDOM_SIZES[name]
    sizes = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2, **RANDOM_EXTRAS.get(name, {}))
    if name == "random-gemma3":
        from transformers import Gemma3TextConfig

        config = Gemma3TextConfig(**sizes, head_dim=hidden // heads, sliding_window=GEMMA3_WINDOW,
                                  layer_types=[("full" if (i + 1) % 6 == 0 else "sliding") + "_attention"
                                               for i in range(layers)])
    else:
        config = LlamaConfig(**sizes)
    config._attn_implementation = "sdpa"
    return config


def random_model(name: str, seed: int, device: str, max_positions: int = 8192, dtype: str = "auto") -> Any:
    """A freshly initialised causal LM of size ``name`` (a key of ``RANDOM_SIZES``), in eval
    mode, its parameters created and initialised on ``device`` in ``dtype`` (see
    ``resolve_dtype``); seeded by ``seed``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = random_config(name, max_positions)
    torch.manual_seed(seed)
    with torch.device(device):  # allocate and initialise in place: no host copy of the weights
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype, device))
    return model.eval()


def load(name: str, seed: int, device: str, dtype: str = "auto") -> LoadedModel:
    """``name`` is a key of ``RANDOM_SIZES``, a local HF folder or a kvpage alias (``smollm2-135m``);
    ``dtype`` is one of ``DTYPES`` (``"auto"``: see ``resolve_dtype`` for random models, the
    checkpoint's own dtype rules for the others)."""
    if name in RANDOM_SIZES:
        model = random_model(name, seed, device, dtype=dtype)
    else:
        from kvpage.engine.builder import load_model
        from kvpage.core.config import EngineConfig

        model, _, _ = load_model(name, None, EngineConfig(device=device, dtype=dtype))
        if model.config._attn_implementation not in ("sdpa", "eager"):
            model.set_attn_implementation("sdpa")
    vocab = int(model.get_input_embeddings().weight.shape[0])
    return LoadedModel(name, model, vocab, kv_bytes_per_token(model))
