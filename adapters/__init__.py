"""Framework adapters (import name ``kvpage.adapters``): the model runner for Hugging Face models.

Owns: the HF model runner (``hf_runner``), the ``kvpage`` attention implementation
registered through transformers' ``AttentionInterface`` (``hf_attention``), the attention
backends behind it (``attention_backends``), the context of the running forward that
attention reads (``forward_context``), the compiled forward, and the per-family quirks
(``families``, the one registry that names model families). May import the layers below
it (``kvpage.attention``, ``kvpage.cuda``, ``kvpage.storage``, ``kvpage.kernels``,
``kvpage.platform``, ``kvpage.core``), torch and transformers; never the engine or the entry points (``pyproject.toml``'s import contracts).

For an already-loaded model, ``kvpage.patch(model, tokenizer, **config)`` (the entry
point ``kvpage.entrypoints.llm.patch``) switches its attention to this package's paged
implementation and returns an ``LLM`` bound to it.
"""
