"""Run one HTTP request through an in-process ASGI app and yield its response as it is sent.

This is how a replica serves the very FastAPI app ``kvpage serve`` runs (routes, validation,
errors, SSE streaming) without a socket: the ingress ships the request over Ray, the
replica drives the app here and streams the pieces back.

Contract of ``run_asgi``: the first item is an ``HttpHead`` (status and headers), every later
item is a non-empty ``bytes`` chunk of the body, in order. Closing the generator early
(the ingress's client went away) tells the app the client disconnected and cancels it,
so the kvpage handlers abort their engine requests and free the KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Union

_DONE = object()


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """A request as the ingress received it; ``headers`` are (lower-case name, value) pairs."""

    method: str
    path: str
    query_string: str
    headers: tuple
    body: bytes


@dataclass(frozen=True, slots=True)
class HttpHead:
    """The response's status and (name, value) headers."""

    status: int
    headers: tuple


def _scope(request: HttpRequest) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
            "query_string": request.query_string.encode(), "root_path": "",
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}


async def run_asgi(app: Any, request: HttpRequest) -> AsyncIterator[Union[HttpHead, bytes]]:
    """Drive ``app`` with ``request``; see the module docstring for what is yielded."""
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(_scope(request), receive, messages.put)
        finally:
            messages.put_nowait(_DONE)

    task = asyncio.create_task(run())
    started = False
    try:
        while True:
            message = await messages.get()
            if message is _DONE:
                break
            if message["type"] == "http.response.start":
                started = True
                yield HttpHead(message["status"], tuple((k.decode("latin-1"), v.decode("latin-1"))
                                                         for k, v in message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
    finally:
        disconnected.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 1.0)  # let it see the disconnect first
            task.cancel()
        with contextlib.suppress(BaseException):
            await task
    if not started:  # the app ended without answering: the ingress turns this into a 500
        raise RuntimeError("the replica's app ended without sending a response")
