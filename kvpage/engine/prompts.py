"""Prompt intake: a text or token-id prompt becomes validated token ids. Torch-free."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Union

from kvpage.core.request import as_token_ids
from kvpage.core.sampling_params import SamplingParams

Prompt = Union[str, Sequence[int]]


class PromptEncoder:
    """Tokenizes text prompts and checks token ids against the model's vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of ``prompt``; raises ``ValueError`` naming what is wrong with it."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise ValueError("the prompt encodes to no tokens")
        else:
            try:  # ints (numpy and 0-d tensors too), never floats, strings, bools or None
                if isinstance(prompt, (bytes, bytearray)):
                    raise TypeError("bytes are not token ids")
                ids = as_token_ids(list(prompt))
            except TypeError:
                raise ValueError("a prompt must be a string or a sequence of integer token ids") from None
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return ids

    def check_params(self, params: SamplingParams) -> None:
        """``ValueError`` where ``params`` names a token outside the vocabulary (``logit_bias``)
        or asks for more top log-probabilities than it holds."""
        bad = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.vocab_size:
                raise ValueError(f"{name}={getattr(params, name)} exceeds the vocabulary of {self.vocab_size} tokens")


def with_eos_stops(params: SamplingParams, eos_token_ids: Sequence[int]) -> SamplingParams:
    """A model with several EOS ids: the first is the request's EOS, the others stop ids."""
    if len(eos_token_ids) < 2 or params.ignore_eos:
        return params
    extra = tuple(t for t in eos_token_ids[1:] if t not in params.stop_token_ids)
    return dataclasses.replace(params, stop_token_ids=tuple(params.stop_token_ids) + extra)
