"""``KVPageIngress``: the HTTP front of the Ray Serve app, forwarding every route to a replica.

The ingress holds no engine and no route logic of its own: it reads the request (refusing
bodies over ``max_body_bytes`` with 413, as the replicas would), computes its routing key
(``routing_key``), and ships it to a ``KVPageReplica`` through the deployment handle, whose
request router picks the replica. Only ``/metrics`` is answered here: the router's metrics
and every replica's last reported ones (``router_metrics``).

Replica failure. A response is held back until the replica has sent its first body bytes
(for a JSON answer, the whole body), so until then nothing has reached the client and a
request whose replica dies (``RayActorError``, ``ActorUnavailableError``) is sent again, to
a live replica, up to ``max_attempts`` times; after that the client gets 503
``replica_unavailable``. A stream whose replica dies after it started ends with an in-band
503 error event and ``[DONE]``. Every wait on a replica is bounded by ``replica_timeout_s``
(then 504).

No ``from __future__ import annotations`` here: FastAPI must see the real ``Request`` type.
"""

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from kvpage.entrypoints.openai.errors import error_body, error_response

from kvpage.entrypoints.ray_serve.asgi_bridge import HttpHead, HttpRequest
from kvpage.entrypoints.ray_serve.routing_key import RoutingKey, routing_key

log = logging.getLogger("kvpage.entrypoints.ray_serve")

ingress_api = FastAPI(title="kvpage on Ray Serve")
_REPLICA_GONE = (RayActorError, ActorUnavailableError)
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


class _ReplicaFailed(Exception):
    """The replica died or stopped answering before the response was committed."""


# Serve pickles the ingress class by value when it is deployed, with copies of the module
# globals that exist at that point: helpers stand above the class, and process-wide state
# (the router's metrics) is imported where it is used.
def _metrics():
    from kvpage.entrypoints.ray_serve import router_metrics  # at call time: the module's object, not a pickled copy

    return router_metrics.ROUTER_METRICS


def _sse_error(message: str) -> bytes:
    return (f"data: {json.dumps(error_body(503, message, code='replica_unavailable'))}\n\n"
            "data: [DONE]\n\n").encode()


async def _next_or_none(stream: Any) -> Optional[bytes]:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _bounded(stream: Any, timeout_s: float) -> AsyncIterator[bytes]:
    """The stream's remaining chunks, each awaited at most ``timeout_s``."""
    while True:
        chunk = await asyncio.wait_for(_next_or_none(stream), timeout_s)
        if chunk is None:
            return
        yield chunk


@serve.ingress(ingress_api)
class KVPageIngress:
    """The ingress deployment's class (``app.build_app`` wraps it in ``serve.deployment``)."""

    def __init__(self, replicas: Any, max_body_bytes: int = 1 << 20, max_attempts: int = 3,
                 replica_timeout_s: float = 600.0) -> None:
        self._replicas = replicas
        self._max_body_bytes = max_body_bytes
        self._max_attempts = max(1, max_attempts)
        self._replica_timeout_s = replica_timeout_s
        self._key_params: Optional[dict] = None
        self._key_params_lock = asyncio.Lock()  # concurrent first requests ask a replica once

    @ingress_api.get("/metrics")
    async def metrics(self) -> Response:
        return Response(generate_latest(_metrics().registry), media_type=CONTENT_TYPE_LATEST)

    @ingress_api.api_route("/{path:path}", methods=_METHODS)
    async def forward(self, request: Request, path: str) -> Response:
        body = await self._read_body(request)
        if body is None:
            return error_response(413, f"request body exceeds {self._max_body_bytes} bytes", code="body_too_large")
        forwarded = HttpRequest(request.method, request.url.path, request.url.query,
                                tuple(request.headers.items()), body)
        key = await self._routing_key(forwarded.path, body)
        failure: Optional[BaseException] = None
        for attempt in range(self._max_attempts):
            try:
                return await self._send(forwarded, key)
            except _ReplicaFailed as exc:
                failure = exc.__cause__ or exc
                _metrics().replica_failures.labels("retried" if attempt + 1 < self._max_attempts else "gave_up").inc()
                log.warning("replica failed before responding (attempt %d of %d): %s", attempt + 1,
                            self._max_attempts, failure)
            except asyncio.TimeoutError:
                return error_response(504, f"no replica answered within {self._replica_timeout_s:g} s",
                                      code="replica_timeout")
            except RayTaskError as exc:
                return error_response(500, f"replica error: {getattr(exc, 'cause', None) or exc}")
        return error_response(503, f"the replica serving this request failed {self._max_attempts} times "
                                   f"({type(failure).__name__}); retry later", code="replica_unavailable",
                              headers={"Retry-After": "1"})

    async def _read_body(self, request: Request) -> Optional[bytes]:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self._max_body_bytes:
                return None
        return bytes(body)

    async def _routing_key(self, path: str, body: bytes) -> RoutingKey:
        async with self._key_params_lock:
            if self._key_params is None:
                try:
                    self._key_params = await asyncio.wait_for(self._replicas.describe.remote(),
                                                              self._replica_timeout_s)
                except (asyncio.TimeoutError, *_REPLICA_GONE):
                    return RoutingKey.empty()  # route by load this once; the next request asks again
        params = self._key_params
        return await asyncio.to_thread(routing_key, path, body, params["tokenizer"], params["block_size"])

    async def _send(self, request: HttpRequest, key: RoutingKey) -> Response:
        """One attempt; raises ``_ReplicaFailed`` while nothing has been committed to the client."""
        stream = self._replicas.options(stream=True).handle_http.remote(request, routing_key=key)
        try:
            head = await asyncio.wait_for(stream.__anext__(), self._replica_timeout_s)
            if not isinstance(head, HttpHead):
                raise RuntimeError(f"replica sent {type(head).__name__} before the response head")
            headers = dict(head.headers)
            if headers.get("content-type", "").startswith("text/event-stream"):
                first = await asyncio.wait_for(_next_or_none(stream), self._replica_timeout_s)
                return StreamingResponse(self._rest(stream, first), status_code=head.status, headers=headers)
            body = b"".join([chunk async for chunk in _bounded(stream, self._replica_timeout_s)])
        except _REPLICA_GONE as exc:
            stream.cancel()
            raise _ReplicaFailed() from exc
        except BaseException:
            stream.cancel()
            raise
        headers.pop("content-length", None)  # Response sets it from the body
        return Response(body, status_code=head.status, headers=headers)

    async def _rest(self, stream: Any, first: Optional[bytes]) -> AsyncIterator[bytes]:
        """The committed part of a stream: a replica failure from here on is reported in-band."""
        try:
            if first is not None:
                yield first
            async for chunk in _bounded(stream, self._replica_timeout_s):
                yield chunk
        except (*_REPLICA_GONE, asyncio.TimeoutError) as exc:
            log.warning("replica failed mid-stream: %s", exc)
            _metrics().replica_failures.labels("in_stream").inc()
            yield _sse_error(f"the replica serving this stream failed ({type(exc).__name__})")
        finally:
            stream.cancel()  # a client that went away: the replica aborts the request
