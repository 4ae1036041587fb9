"""What a KV cache format costs in quality: perplexity on real English text and greedy agreement.

The text is the prose of Python's own documentation as the interpreter ships it
(``pydoc_data.topics``: the language reference's topics), paragraphs of English only (no
grammar rules, code or tables), so the figures come from text nobody generated. Perplexity
is taken through the engine itself: each window of the text is one prompt whose prompt
log-probabilities kvpage computes, so every key and value the attention reads has gone
through the cache in the format under test (the prompt's own chunk included).

:func:`measure_quality` runs every format on one model, loading it once per format; the
benchmark ``benchmarks/bench_kv_quality.py`` and ``tests/test_kv_quality.py`` call it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

#: A paragraph is prose when it has at least this many characters and these shares.
_MIN_CHARS, _MIN_LETTER_SHARE = 200, 0.8
_CODE_MARKERS = ("::=", ">>>", "...", "**", "``", "|", "__")


def english_prose(max_chars: Optional[int] = None) -> str:
    """Paragraphs of English prose from Python's documentation topics, in a fixed order,
    joined by blank lines; at most ``max_chars`` characters (whole paragraphs)."""
    from pydoc_data.topics import topics

    kept, total = [], 0
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            lines = paragraph.splitlines()
            if not lines or any(line.startswith("   ") for line in lines):
                continue  # an indented block: code, a grammar rule or a table
            text = " ".join(line.strip() for line in lines)
            if not _is_prose(text):
                continue
            if max_chars is not None and total + len(text) > max_chars:
                return "\n\n".join(kept)
            kept.append(text)
            total += len(text) + 2
    return "\n\n".join(kept)


def _is_prose(text: str) -> bool:
    if len(text) < _MIN_CHARS or not text.endswith(".") or any(m in text for m in _CODE_MARKERS):
        return False
    letters = sum(ch.isalpha() or ch.isspace() for ch in text)
    return letters / len(text) >= _MIN_LETTER_SHARE


@dataclass
class FormatQuality:
    """One format's figures. ``perplexity`` over ``tokens`` scored tokens; ``agreement`` the
    share of prompts whose greedy continuation equals the reference format's, and
    ``common_prefix`` the mean share of tokens before the first difference."""

    kv_cache_dtype: str
    perplexity: float
    tokens: int
    agreement: Optional[float] = None
    common_prefix: Optional[float] = None
    kv_bytes_per_token: Optional[int] = None
    continuations: list = field(default_factory=list, repr=False)


def text_windows(tokenizer: Any, text: str, window: int, max_windows: int) -> list[list[int]]:
    """The text's tokens cut into at most ``max_windows`` prompts of ``window`` tokens each."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    count = min(max_windows, len(ids) // window)
    if count < 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    return [ids[i * window:(i + 1) * window] for i in range(count)]


def perplexity(llm: Any, windows: Sequence[Sequence[int]]) -> tuple[float, int]:
    """exp(mean negative log-likelihood) of every window's tokens after its first, and how many."""
    from kvpage import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([list(w) for w in windows], params, use_tqdm=False)
    logprobs = [entry.logprob for out in outputs for entry in out.prompt_logprobs if entry is not None]
    return math.exp(-sum(logprobs) / len(logprobs)), len(logprobs)


def greedy_continuations(llm: Any, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    from kvpage import SamplingParams

    outputs = llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def _agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    same = sum(a == b for a, b in zip(reference, other)) / len(reference)
    prefixes = []
    for a, b in zip(reference, other):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(n / max(len(a), 1))
    return same, sum(prefixes) / len(prefixes)


def kv_bytes_per_token(config: Any, kv_cache_dtype: str, dtype: str) -> int:
    """K and V bytes one token takes in every layer of a standard decoder (scales included)."""
    from kvpage.core.kv_formats import resolve_kv_format

    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    fmt = resolve_kv_format(kv_cache_dtype, dtype)
    return 2 * config.num_hidden_layers * heads * fmt.row_bytes(head_dim)


def measure_quality(model: str, formats: Sequence[str], dtype: str = "bfloat16", window: int = 512,
                    max_windows: int = 8, max_chars: Optional[int] = None, prompts: Sequence[str] = (),
                    max_tokens: int = 48, **engine: Any) -> list[FormatQuality]:
    """Perplexity (and, with ``prompts``, greedy agreement with ``formats[0]``) of each KV
    format on ``model`` at ``dtype``; ``engine`` goes to ``LLM`` (by default in the exact
    mode, so that the formats are the only difference and nothing compiles)."""
    from kvpage import LLM

    engine.setdefault("exact", not {"enforce_eager", "onednn_linears"} & set(engine))

    text = english_prose(max_chars)
    results: list[FormatQuality] = []
    for name in formats:
        llm = LLM(model, dtype=dtype, kv_cache_dtype=name, **engine)
        try:
            windows = text_windows(llm.tokenizer, text, window, max_windows)
            ppl, tokens = perplexity(llm, windows)
            row = FormatQuality(name, ppl, tokens, kv_bytes_per_token=kv_bytes_per_token(llm.model.config, name, dtype))
            if prompts:
                row.continuations = greedy_continuations(llm, prompts, max_tokens)
        finally:
            llm.close()
        if prompts and results:
            row.agreement, row.common_prefix = _agreement(results[0].continuations, row.continuations)
        results.append(row)
    return results
