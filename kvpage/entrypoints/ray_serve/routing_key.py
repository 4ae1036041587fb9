"""The routing key of an HTTP request: the chained block hashes of the prompt it will run.

The ingress computes it with the replicas' tokenizer and block size, the same way the
replica's engine will tokenize the prompt (``handlers.prompt_token_ids`` and
``handlers.chat_token_ids``), so the hashes meet the ones the replica's radix cache reports.
A request that cannot be parsed gets the empty key: the replica answers it (usually with
the 4xx it deserves) and the router balances it by load. A completions request with several
prompts is keyed by its first.
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple

from kvpage.core.block_hash import prompt_block_hashes
from kvpage.entrypoints.openai import handlers
from kvpage.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

# Hashing a long prompt costs the ingress CPU; past this many blocks the prefix is decisive anyway.
MAX_KEY_BLOCKS = 256


class RoutingKey(NamedTuple):
    """``block_hashes``: the prompt's full blocks (first first); ``num_prompt_tokens``: its length."""

    block_hashes: tuple
    num_prompt_tokens: int
    block_size: int

    @classmethod
    def empty(cls) -> "RoutingKey":
        return cls((), 0, 0)


def _prompt_ids(path: str, data: Any, tokenizer: Any) -> list[int]:
    if path.rstrip("/") == "/v1/completions":
        prompts = CompletionRequest.model_validate(data).prompts()
        return handlers.prompt_token_ids(tokenizer, prompts[0]) if prompts else []
    if path.rstrip("/") == "/v1/chat/completions":
        return handlers.chat_token_ids(tokenizer, ChatCompletionRequest.model_validate(data))
    return []


def routing_key(path: str, body: bytes, tokenizer: Any, block_size: int) -> RoutingKey:
    """The key of a request to ``path`` with JSON ``body``; never raises (bad input: the empty key)."""
    try:
        ids = _prompt_ids(path, json.loads(body or b"null"), tokenizer)
    except Exception:  # noqa: BLE001 - bad JSON, a bad field, a tokenizer failure: the replica reports it
        return RoutingKey.empty()
    if not ids:  # not a generation route
        return RoutingKey.empty()
    return RoutingKey(tuple(prompt_block_hashes(ids, block_size, max_blocks=MAX_KEY_BLOCKS)), len(ids), block_size)
