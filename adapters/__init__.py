"""Framework adapters (import name ``kvpage.adapters``): Hugging Face transformers.

Owns: the HF model runner (``hf_runner``), the ``kvpage`` attention implementation
registered through transformers' ``AttentionInterface`` (``hf_attention``), the attention
backends behind it (``attention_backends``), and model loading plus engine assembly
(``hf_engine``). May import: ``kvpage.core``, ``kvpage.attention``, ``kvpage.cuda``, the
engine contracts (``kvpage.interfaces``, ``kvpage.engine``), torch and transformers; never
the front ends (``kvpage.llm``, the server, the benchmarks).

``patch(model, **config)`` is the drop-in for an already-loaded model: it switches the
model's attention to kvpage's paged implementation (no model class is modified) and
returns an ``LLM`` bound to it. It is the front end's function (``kvpage.llm.patch``),
named here too because users look for it here; it is resolved on first use, so importing
this package never imports the front end.
"""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "patch":
        from kvpage.llm import patch

        return patch
    raise AttributeError(f"module 'kvpage.adapters' has no attribute {name!r}")


__all__ = ["patch"]
