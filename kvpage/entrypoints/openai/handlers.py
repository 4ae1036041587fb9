"""Completion and chat-completion logic: requests in, OpenAI-shaped JSON or SSE chunks out.

Every prompt of a request is validated and queued before the response starts, so bad
input is always a 4xx and never a broken stream.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from kvpage.engine.async_llm import AsyncLLM, RequestStream
from kvpage.engine.outputs import RequestOutput

from kvpage.entrypoints.openai import logprobs_format as fmt
from kvpage.entrypoints.openai.errors import error_body
from kvpage.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


class GenerationError(RuntimeError):
    """A request failed inside the engine (finish_reason == "error")."""


@dataclass
class ServingContext:
    """What every handler needs. ``max_request_seconds``: the server-wide deadline (None: none)."""

    llm: AsyncLLM
    tokenizer: Any
    model_name: str
    max_model_len: int
    max_tokens_cap: int
    default_max_tokens: int = 16
    vocab_size: Optional[int] = None
    max_request_seconds: Optional[float] = None

    def timeout_s(self, requested: Optional[float]) -> Optional[float]:
        """The request's deadline in seconds: the shorter of its ``timeout`` and the server's."""
        given = [t for t in (requested, self.max_request_seconds) if t is not None]
        return min(given) if given else None


def _max_tokens(ctx: ServingContext, requested: Optional[int], prompt_len: int) -> int:
    """Tokens the engine generates; ``max_tokens == 0`` (echo only) still runs one, never shown.
    A ``max_tokens`` past the context left after the prompt is a ``ValueError`` (as vLLM's)."""
    room = ctx.max_model_len - prompt_len
    if requested is None:
        return max(1, min(ctx.default_max_tokens, room, ctx.max_tokens_cap))
    if requested > ctx.max_tokens_cap:
        raise ValueError(f"max_tokens={requested} exceeds this server's cap of {ctx.max_tokens_cap}")
    if requested > room:
        raise ValueError(f"this model's maximum context length is {ctx.max_model_len} tokens, but "
                         f"{prompt_len + requested} were requested ({prompt_len} in the prompt, max_tokens={requested})")
    return max(requested, 1)


def prompt_token_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """The token ids of one completions prompt: a string (encoded) or a list of ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return list(tokenizer.encode(prompt))
    return [int(t) for t in prompt]


def _prompt_ids(ctx: ServingContext, prompt: Any) -> list[int]:
    return prompt_token_ids(ctx.tokenizer, prompt)


async def _submit_all(ctx: ServingContext, prompts: list, make_params,
                      timeout_s: Optional[float] = None) -> list[tuple[list[int], RequestStream]]:
    """Queue every prompt or none: a bad one aborts those already queued."""
    queued: list[tuple[list[int], RequestStream]] = []
    try:
        for prompt in prompts:
            ids = _prompt_ids(ctx, prompt)
            if len(ids) >= ctx.max_model_len:
                raise ValueError(f"the prompt has {len(ids)} tokens; the context length is {ctx.max_model_len}")
            queued.append((ids, await ctx.llm.add_request(ids, make_params(len(ids)), timeout_s=timeout_s)))
    except BaseException:
        for _, stream in queued:
            stream.abort()
        raise
    return queued


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several streams as they come, tagged with the stream's position."""
    merged: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(position: int, stream: RequestStream) -> None:
        try:
            async for item in stream:
                await merged.put((position, item))
        except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
            await merged.put((position, exc))
        finally:
            await merged.put((position, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            position, item = await merged.get()
            if item is done:
                remaining -= 1
                continue
            if isinstance(item, Exception):
                raise item
            yield position, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


def _usage(prompt_ids: list[list[int]], finals: list[RequestOutput], count_output: bool = True) -> dict:
    prompt_tokens = sum(len(p) for p in prompt_ids)
    completion_tokens = sum(len(c.token_ids) for f in finals for c in f.outputs) if count_output else 0
    cached = sum(f.metrics.num_cached_tokens for f in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def _check_errors(finals: list[RequestOutput]) -> None:
    for final in finals:
        for sample in final.outputs:
            if sample.finish_reason == "error":
                raise GenerationError(sample.error or "generation failed")


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


# ---------------------------------------------------------------------- completions
def _choice(ctx: ServingContext, req: CompletionRequest, index: int, prompt: Any, prompt_ids: list[int],
            final: RequestOutput, sample: Any) -> dict:
    """One completions choice; with ``echo`` the prompt (and its log-probabilities) comes first."""
    echo_only = req.max_tokens == 0
    token_ids, logprobs = ([], None) if echo_only else (sample.token_ids, sample.logprobs)
    echoed = (prompt if isinstance(prompt, str) else ctx.tokenizer.decode(prompt_ids)) if req.echo else ""
    choice = {"index": index, "text": echoed + ("" if echo_only else sample.text), "logprobs": None,
              "finish_reason": sample.finish_reason}
    if req.logprobs is not None:
        parts = [fmt.generated_parts(ctx.tokenizer, token_ids, logprobs)]
        if req.echo:
            parts.insert(0, fmt.prompt_parts(ctx.tokenizer, prompt_ids, final.prompt_logprobs, req.logprobs))
        choice["logprobs"] = fmt.completion_logprobs(*parts)
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = fmt.vllm_prompt_logprobs(ctx.tokenizer, final.prompt_logprobs,
                                                             req.prompt_logprobs)
    return choice


async def completions(ctx: ServingContext, req: CompletionRequest):
    """Returns a JSON dict, or an async iterator of SSE strings when ``req.stream``."""
    req.check_echo()
    prompts = req.prompts()

    def params(prompt_len: int):
        return req.to_sampling_params(_max_tokens(ctx, req.max_tokens, prompt_len), req.logprobs,
                                      req.num_prompt_logprobs)

    queued = await _submit_all(ctx, prompts, params, ctx.timeout_s(req.timeout))
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    prompt_ids = [ids for ids, _ in queued]
    streams = [s for _, s in queued]
    if req.stream:
        return _stream_completions(ctx, req, rid, created, prompts, prompt_ids, streams)
    finals: list[Optional[RequestOutput]] = [None] * len(streams)
    async for position, item in _merged(streams):
        if isinstance(item, RequestOutput):
            finals[position] = item
    _check_errors(finals)
    choices = [_choice(ctx, req, p * req.n + sample.index, prompts[p], prompt_ids[p], final, sample)
               for p, final in enumerate(finals) for sample in final.outputs]
    usage = _usage(prompt_ids, finals, count_output=req.max_tokens != 0)
    return {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
            "choices": choices, "usage": usage}


async def _stream_completions(ctx, req, rid, created, prompts, prompt_ids, streams) -> AsyncIterator[str]:
    base = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}
    finals: list[RequestOutput] = []
    ended: set[tuple[int, int]] = set()  # (prompt, sample) whose finish_reason was sent
    offsets: dict[int, int] = {}  # choice index -> where its next token starts in its text
    if req.echo:
        for p, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else ctx.tokenizer.decode(prompt_ids[p])
            for k in range(req.n):
                offsets[p * req.n + k] = len(text)
                yield _sse({**base, "choices": [{"index": p * req.n + k, "text": text, "logprobs": None,
                                                 "finish_reason": None}]})
    try:
        async for position, item in _merged(streams):
            if isinstance(item, RequestOutput):
                finals.append(item)
                for chunk in _unsent_endings(base, position, req.n, item, ended):
                    yield chunk
                continue
            if item.error:
                yield _sse(error_body(500, item.error, code="generation_error"))
                continue
            if item.finish_reason is not None:
                ended.add((position, item.index))
            index = position * req.n + item.index
            logprobs = None
            if req.logprobs is not None:
                logprobs = fmt.completion_logprobs(fmt.generated_parts(ctx.tokenizer, item.token_ids, item.logprobs),
                                                   start=offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(token) for token in logprobs["tokens"])
            choice = {"index": index, "text": item.text, "logprobs": logprobs, "finish_reason": item.finish_reason}
            yield _sse({**base, "choices": [choice]})
        if req.include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(prompt_ids, finals)})
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        yield _sse(error_body(500, str(exc), code="generation_error"))
    yield "data: [DONE]\n\n"


def _unsent_endings(base: dict, position: int, n: int, final: RequestOutput, ended: set) -> list[str]:
    """Chunks with the finish_reason of samples that ended outside a step (a deadline, an abort)."""
    return [_sse({**base, "choices": [{"index": position * n + s.index, "text": "", "logprobs": None,
                                       "finish_reason": s.finish_reason}]})
            for s in final.outputs if (position, s.index) not in ended and s.finish_reason is not None]


# ---------------------------------------------------------------------- chat
def chat_token_ids(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    """The prompt a chat request becomes: its messages through the chat template, then encoded."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_prompt_ids(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    return chat_token_ids(ctx.tokenizer, req)


def _chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: Optional[list], top: int) -> Optional[dict]:
    if logprobs is None:
        return None
    content = []
    for token, entry in zip(token_ids, logprobs):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        content.append({"token": tokenizer.decode([token]), "logprob": entry.get(token),
                        "bytes": list(tokenizer.decode([token]).encode()),
                        "top_logprobs": [{"token": tokenizer.decode([k]), "logprob": v,
                                          "bytes": list(tokenizer.decode([k]).encode())} for k, v in ranked]})
    return {"content": content}


async def chat_completions(ctx: ServingContext, req: ChatCompletionRequest):
    ids = chat_prompt_ids(ctx, req)
    requested = req.max_completion_tokens or req.max_tokens
    top = req.top_logprobs or 0
    logprobs = top if req.logprobs else None

    def params(prompt_len: int):
        return req.to_sampling_params(_max_tokens(ctx, requested, prompt_len) if requested else
                                      max(1, min(ctx.max_model_len - prompt_len, ctx.max_tokens_cap)), logprobs,
                                      req.prompt_logprobs)

    queued = await _submit_all(ctx, [ids], params, ctx.timeout_s(req.timeout))
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    stream = queued[0][1]
    if req.stream:
        return _stream_chat(ctx, req, rid, created, ids, stream, top)
    final: Optional[RequestOutput] = None
    async for item in stream:
        if isinstance(item, RequestOutput):
            final = item
    _check_errors([final])
    choices = [{"index": s.index, "message": {"role": "assistant", "content": s.text},
                "logprobs": _chat_logprobs(ctx.tokenizer, s.token_ids, s.logprobs, top),
                "finish_reason": s.finish_reason} for s in final.outputs]
    response = {"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
                "choices": choices, "usage": _usage([ids], [final])}
    if req.prompt_logprobs is not None:
        response["prompt_logprobs"] = fmt.vllm_prompt_logprobs(ctx.tokenizer, final.prompt_logprobs,
                                                               req.prompt_logprobs)
    return response


async def _stream_chat(ctx, req, rid, created, ids, stream, top) -> AsyncIterator[str]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}
    for index in range(req.n):
        yield _sse({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]})
    final: Optional[RequestOutput] = None
    ended: set[int] = set()
    try:
        async for _, item in _merged([stream]):
            if isinstance(item, RequestOutput):
                final = item
                for s in (s for s in item.outputs if s.index not in ended and s.finish_reason is not None):
                    yield _sse({**base, "choices": [{"index": s.index, "delta": {}, "logprobs": None,
                                                     "finish_reason": s.finish_reason}]})
                continue
            if item.error:
                yield _sse(error_body(500, item.error, code="generation_error"))
                continue
            if item.finish_reason is not None:
                ended.add(item.index)
            delta = {"content": item.text} if item.text else {}
            yield _sse({**base, "choices": [{"index": item.index, "delta": delta,
                                             "logprobs": _chat_logprobs(ctx.tokenizer, item.token_ids,
                                                                        item.logprobs, top),
                                             "finish_reason": item.finish_reason}]})
        if req.include_usage and final is not None:
            yield _sse({**base, "choices": [], "usage": _usage([ids], [final])})
    except Exception as exc:  # noqa: BLE001
        yield _sse(error_body(500, str(exc), code="generation_error"))
    yield "data: [DONE]\n\n"
