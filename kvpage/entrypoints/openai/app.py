"""The FastAPI application: routes, authentication, body limits and error mapping.

Every failure leaves as OpenAI-shaped JSON: 400 bad input, 401 bad key, 413 body too
large, 503 queue full (with ``Retry-After``), 500 for a failed generation.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
from typing import Any, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpage import __version__
from kvpage.engine.async_llm import AsyncLLM
from kvpage.core.sched.output import QueueFullError

from kvpage.entrypoints.openai import handlers, tokenization
from kvpage.entrypoints.openai.errors import error_response
from kvpage.entrypoints.openai.metrics import ServerMetrics
from kvpage.entrypoints.openai.stats_log import log_stats_forever
from kvpage.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413, whether or not Content-Length is sent."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._reject(scope, receive, send)

    async def _reject(self, scope, receive, send):
        response = error_response(413, f"request body exceeds {self.max_bytes} bytes", code="body_too_large")
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def _first_validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return "malformed JSON body", None
    if first.get("type") == "value_error":  # a check across fields: the error names its own parameter
        cause = first.get("ctx", {}).get("error")
        message = str(cause) if cause is not None else message.removeprefix("Value error, ")
        param = param or getattr(cause, "param", None)
        return message, param
    return (f"{param}: {message}" if param else message), param


def _key_checker(api_key: Optional[str]):
    """A route dependency: with ``api_key`` set, require ``Authorization: Bearer <key>``."""

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), api_key):
            raise _AuthError()

    return check_key


def build_app(llm: AsyncLLM, tokenizer: Any, served_model_names: list[str], max_model_len: int,
              api_key: Optional[str] = None, max_body_bytes: int = 1 << 20, max_tokens_cap: int = 4096,
              max_request_seconds: Optional[float] = None, stats_interval_s: float = 0.0) -> FastAPI:
    """Create the app around a started ``AsyncLLM``; the first served name is reported as the model.

    ``max_request_seconds``: every request's deadline (None: none). ``stats_interval_s``:
    seconds between stats log lines while the app runs (0: none).
    """
    app = FastAPI(title="kvpage", version=__version__, lifespan=_lifespan(llm, stats_interval_s))
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    metrics = ServerMetrics(llm.stats)
    llm.observers.append(metrics.observe_step)
    ctx = handlers.ServingContext(llm, tokenizer, served_model_names[0], max_model_len, max_tokens_cap,
                                  vocab_size=llm.vocab_size, max_request_seconds=max_request_seconds)
    app.state.metrics, app.state.ctx = metrics, ctx

    check_key = _key_checker(api_key)

    def check_model(name: Optional[str]) -> None:
        if name is not None and name not in served_model_names:
            raise _model_not_found(name, served_model_names)

    _install_error_handlers(app)
    _service_routes(app, llm, metrics)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kvpage",
                                            "max_model_len": max_model_len} for name in served_model_names]}

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest):
        check_model(body.model)
        return _respond(await handlers.completions(ctx, body))

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(body: ChatCompletionRequest):
        check_model(body.model)
        return _respond(await handlers.chat_completions(ctx, body))

    _tokenizer_routes(app, ctx, check_key, check_model)
    return app


def _lifespan(llm: AsyncLLM, stats_interval_s: float):
    """The app's lifespan: logs stats every ``stats_interval_s`` seconds (0: never) while it
    runs, and shuts the engine down after uvicorn's graceful period (aborting what is left)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        stats_task = asyncio.create_task(log_stats_forever(llm.stats, stats_interval_s)) if stats_interval_s else None
        yield
        if stats_task is not None:
            stats_task.cancel()
        llm.shutdown()

    return lifespan


def _service_routes(app: FastAPI, llm: AsyncLLM, metrics: ServerMetrics) -> None:
    """``/health`` (503 once the engine thread stopped) and ``/metrics`` (Prometheus); no key needed."""

    @app.get("/health")
    async def health():
        if not llm.is_running:
            return error_response(503, "engine is not running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _tokenizer_routes(app: FastAPI, ctx: handlers.ServingContext, check_key, check_model) -> None:
    """``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` (see ``tokenization``)."""

    @app.post("/tokenize", dependencies=[Depends(check_key)])
    async def tokenize(body: tokenization.TokenizeRequest):
        check_model(body.model)
        return tokenization.tokenize(ctx.tokenizer, ctx.max_model_len, body)

    @app.post("/detokenize", dependencies=[Depends(check_key)])
    async def detokenize(body: tokenization.DetokenizeRequest):
        check_model(body.model)
        return tokenization.detokenize(ctx.tokenizer, ctx.vocab_size, body)

    @app.get("/tokenizer_info", dependencies=[Depends(check_key)])
    async def tokenizer_info():
        return tokenization.tokenizer_info(ctx.tokenizer, ctx.max_model_len)


def _install_error_handlers(app: FastAPI) -> None:
    """Map every failure to an OpenAI-shaped error response."""

    @app.exception_handler(_AuthError)
    async def _auth(_: Request, __: _AuthError):
        return error_response(401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        message, param = _first_validation_message(exc)
        return error_response(400, message, param=param, code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError):
        param = getattr(exc, "param", None)
        return error_response(400, str(exc), param=param, code=getattr(exc, "code", "invalid_request"))

    @app.exception_handler(QueueFullError)
    async def _full(_: Request, exc: QueueFullError):
        return error_response(503, str(exc), code="queue_full", headers={"Retry-After": "1"})

    @app.exception_handler(handlers.GenerationError)
    async def _failed(_: Request, exc: handlers.GenerationError):
        return error_response(500, str(exc), code="generation_error")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


class _AuthError(Exception):
    pass


def _model_not_found(name: str, served: list[str]) -> ValueError:
    error = ValueError(f"the model {name!r} does not exist; this server serves {served}")
    error.param, error.code = "model", "model_not_found"  # type: ignore[attr-defined]
    return error


def _respond(result: Any):
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
