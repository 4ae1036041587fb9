"""Log-probabilities in the shapes clients expect.

- OpenAI's completions format (``choice["logprobs"]``): parallel lists ``tokens``,
  ``token_logprobs``, ``top_logprobs`` (``{decoded token: logprob}``) and ``text_offset``
  (where each token starts in the choice's ``text``). With ``echo`` the prompt's tokens
  come first; the first prompt token has no log-probability (``None`` in both lists).
- vLLM's ``prompt_logprobs`` (``choice["prompt_logprobs"]``): one entry per prompt token,
  ``None`` first, then ``{str(token_id): {"logprob", "rank", "decoded_token"}}`` for the
  prompt token and its ``k`` most likely alternatives.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from kvpage.engine.outputs import PromptTokenLogprob

_Parts = tuple[list[str], list[Optional[float]], list[Optional[dict]]]


def prompt_parts(tokenizer: Any, prompt_ids: Sequence[int], entries: Sequence[Optional[PromptTokenLogprob]],
                 num_top: int) -> _Parts:
    """Tokens, their log-probabilities and top alternatives for the echoed prompt."""
    tokens = [tokenizer.decode([t]) for t in prompt_ids]
    logprobs: list[Optional[float]] = [None if e is None else e.logprob for e in entries]
    tops: list[Optional[dict]] = []
    for entry in entries:
        if entry is None:
            tops.append(None)
            continue
        top = {tokenizer.decode([t]): v for t, v in list(entry.top.items())[:num_top]}
        top.setdefault(tokenizer.decode([entry.token_id]), entry.logprob)
        tops.append(top)
    return tokens, logprobs, tops


def generated_parts(tokenizer: Any, token_ids: Sequence[int], logprobs: Optional[Sequence[dict]]) -> _Parts:
    """Tokens, their log-probabilities and top alternatives for generated tokens."""
    entries = list(logprobs or [{} for _ in token_ids])
    return ([tokenizer.decode([t]) for t in token_ids], [lp.get(t) for t, lp in zip(token_ids, entries)],
            [{tokenizer.decode([k]): v for k, v in lp.items()} for lp in entries])


def completion_logprobs(*parts: _Parts, start: int = 0) -> dict:
    """OpenAI's completions ``logprobs`` object from consecutive parts (prompt, then output);
    ``text_offset`` counts from ``start`` (a stream's chunk: the text sent before it)."""
    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top_logprobs: list[Optional[dict]] = []
    for part_tokens, part_logprobs, part_tops in parts:
        tokens += part_tokens
        token_logprobs += part_logprobs
        top_logprobs += part_tops
    offsets, at = [], start
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer: Any, entries: Sequence[Optional[PromptTokenLogprob]], num_top: int) -> list:
    """vLLM's ``prompt_logprobs`` list (see the module docstring)."""
    out: list[Optional[dict]] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        item = {str(t): {"logprob": v, "rank": rank, "decoded_token": tokenizer.decode([t])}
                for rank, (t, v) in enumerate(list(entry.top.items())[:num_top], start=1)}
        item[str(entry.token_id)] = {"logprob": entry.logprob, "rank": entry.rank,
                                     "decoded_token": tokenizer.decode([entry.token_id])}
        out.append(item)
    return out
