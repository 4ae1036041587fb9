"""Scheduling policy: who runs, who gives way, who stops. Pure decisions, no block mechanics.

The mechanics (allocating, freeing, moving requests between queues) are ``Scheduler``'s and
``Admission``'s; they ask these functions and never decide on their own.
"""
from __future__ import annotations

from typing import Collection, Optional, Sequence

from kvpage.core.request import FinishReason, Request


def sort_key(request: Request) -> tuple:
    """The order of the running list and of victims (``Request.sort_key``)."""
    return request.sort_key


def split_running(running: Sequence[Request]) -> tuple[list[Request], list[Request]]:
    """Running requests in the order they get the step's budget: (every decode, one token
    each; then the next chunk of each partially computed prompt), each group in scheduling
    order, so a long prefill never starves running decodes."""
    decodes: list[Request] = []
    prefills: list[Request] = []
    for request in running:
        (decodes if request.num_uncomputed_tokens == 1 else prefills).append(request)
    return decodes, prefills


def pick_victim(running: Sequence[Request], scheduled: Collection[int], pin_after: int) -> Request:
    """The request to preempt: the newest running one not yet scheduled this step (``scheduled``
    holds their ``id``), sparing those preempted ``pin_after`` times already if possible."""
    candidates = [r for r in running if id(r) not in scheduled]
    unpinned = [r for r in candidates if r.num_preemptions < pin_after]
    return max(unpinned or candidates, key=sort_key)


def uses_prefix_cache(request: Request) -> bool:
    """Prompt log-probabilities need logits at every prompt position, so such a request
    computes its whole prompt (it may still hit the cache when recomputed after preemption)."""
    return request.sampling_params.prompt_logprobs is None or request.num_output_tokens > 0


def seats(request: Request) -> int:
    """Running slots a request will take: ``n`` before its first token (its samples fork then)."""
    return request.sampling_params.n if request.num_output_tokens == 0 else 1


def stop_reason(request: Request, token: int, max_model_len: int) -> Optional[FinishReason]:
    """Why ``request`` ends now that ``token`` was appended to it, or None if it goes on."""
    params = request.sampling_params
    produced = request.num_output_tokens
    if produced >= params.min_tokens:
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and request.eos_token_id is not None and token == request.eos_token_id:
            return FinishReason.STOP
    if produced >= params.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
