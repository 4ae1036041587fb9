"""Framework adapters (import name ``kvpage.adapters``): Hugging Face transformers.

``patch(model, **config)`` is the drop-in for an already-loaded model: it switches the
model's attention to kvpage's paged implementation (through transformers'
``AttentionInterface``; no model class is modified) and returns an ``LLM`` bound to it.
Plain ``model.generate`` keeps working while patched; ``llm.restore()`` (or
``model.set_attn_implementation("sdpa")``) gives the model back stock attention.
"""
from __future__ import annotations

from typing import Any


def patch(model: Any, tokenizer: Any = None, **config: Any):
    """Bind a paged, continuously batching ``LLM`` to a loaded HF model.

    ``config`` takes the ``LLM`` keyword arguments (block_size, num_kv_blocks,
    max_num_seqs, enable_chunked_prefill, ...). Raises ``UnsupportedModelError`` (a
    ``ValueError``) naming the reason when the model's attention cannot be paged.
    """
    from kvpage.llm import LLM

    return LLM(model, tokenizer=tokenizer, **config)


__all__ = ["patch"]
