"""``KVPageReplica``: one Ray Serve replica owning one ``AsyncLLM`` and ``kvpage serve``'s app.

The replica builds exactly what ``kvpage serve`` builds (``openai.startup`` warms
the model, ``server.app.build_app`` makes the FastAPI app) and answers the ingress's
forwarded HTTP requests by driving that app in process (``asgi_bridge.run_asgi``), so
routes, validation, OpenAI-shaped errors and SSE streaming are the same code.

For the router it reports, through Serve's ``record_routing_stats`` hook, the chained hashes
of the blocks its radix cache holds (``RadixCache.block_hashes``, most recent
``max_reported_blocks``), its block size, engine statistics, and its Prometheus exposition
text (the per-replica metrics the ingress re-exports). ``check_health`` fails once the
engine thread has died, so Serve replaces the replica.
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Optional, Union

from prometheus_client import generate_latest

from kvpage.engine.async_llm import AsyncLLM
from kvpage.core.config import EngineConfig

from kvpage.entrypoints.ray_serve.asgi_bridge import HttpHead, HttpRequest, run_asgi
from kvpage.entrypoints.ray_serve.routing_key import RoutingKey

log = logging.getLogger("kvpage.entrypoints.ray_serve")

DEFAULT_MAX_REPORTED_BLOCKS = 65536


class KVPageReplica:
    """The deployment's class (``app.build_app`` wraps it in ``serve.deployment``).

    ``engine``: ``EngineConfig`` fields; ``server``: ``build_app``'s keyword arguments
    (``served_model_names``, ``api_key``, ``max_body_bytes``, ``max_tokens_cap``,
    ``max_request_seconds``).
    """

    def __init__(self, model: str, engine: dict, server: dict,
                 max_reported_blocks: int = DEFAULT_MAX_REPORTED_BLOCKS) -> None:
        from kvpage.entrypoints.llm import LLM
        from kvpage.entrypoints.openai.startup import engine_summary, warm_up
        from kvpage.entrypoints.openai.app import build_app

        config = EngineConfig(**engine)
        llm = LLM(model, config=config)
        for line in engine_summary(llm, config):
            log.info("%s", line)
        warm_up(llm)
        self._llm = AsyncLLM(llm.engine).start()
        self._tokenizer = llm.tokenizer
        self._block_size = config.block_size
        self._max_reported_blocks = max_reported_blocks
        options = dict(server)
        names = options.pop("served_model_names", None) or [model]
        self._app = build_app(self._llm, llm.tokenizer, names, llm.max_model_len,
                              stats_interval_s=0.0, **options)

    async def handle_http(self, request: HttpRequest,
                          routing_key: Optional[RoutingKey] = None) -> AsyncIterator[Union[HttpHead, bytes]]:
        """Serve one forwarded request (``asgi_bridge.run_asgi``'s contract); ``routing_key`` is the router's."""
        async for item in run_asgi(self._app, request):
            yield item

    def describe(self) -> dict:
        """What the ingress needs to key requests: the tokenizer and the block size."""
        return {"tokenizer": self._tokenizer, "block_size": self._block_size}

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing-stats hook (see the module docstring)."""
        hashes = await self._llm.cached_block_hashes(self._max_reported_blocks)
        return {"block_size": self._block_size, "block_hashes": hashes, "engine": self._llm.stats(),
                "metrics_text": generate_latest(self._app.state.metrics.registry).decode()}

    def check_health(self) -> None:
        if not self._llm.is_running:
            raise RuntimeError("the kvpage engine thread is not running")

    def __del__(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            llm.shutdown()
