"""``AsyncLLM``: the engine on a background thread, driven from asyncio.

One thread owns the ``LLMEngine`` and runs the step loop; every other coroutine talks
to it through a command queue, so concurrent callers join the same continuous batch and
the engine is never touched from two threads. Results flow back to each caller's event
loop through ``call_soon_threadsafe`` into a per-request ``asyncio.Queue``: the queue's
sink is handed to the engine with the request, so no request map lives here.

Contract of ``generate``: it yields ``StreamDelta`` objects as tokens are produced and,
last, the request's final ``RequestOutput``. Cancelling the consumer (a client that
disconnects) aborts the request, which frees its blocks.

A request given ``timeout_s`` has a deadline, counted from ``add_request``: once per loop
iteration (so once per step) the engine thread ends every request past its deadline with
``finish_reason == "length"``, keeping the tokens made so far, and frees its blocks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional, Union

from kvpage.core.request import FinishReason
from kvpage.core.sampling_params import SamplingParams
from kvpage.engine.llm_engine import LLMEngine
from kvpage.engine.outputs import RequestOutput, StreamDelta
from kvpage.engine.prompts import Prompt
from kvpage.platform.threads import release_thread_pools

log = logging.getLogger("kvpage.engine.async_llm")


class AsyncLLM:
    """Thread-backed async front of an ``LLMEngine``. Start it once; stop with ``shutdown``."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._commands: "queue.Queue[Callable[[], None]]" = queue.Queue()
        self._ids = itertools.count()
        self._idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stats: dict = engine.stats()
        self._finished_this_step: dict[str, RequestOutput] = {}
        # (deadline, arrival, request id, sink): engine thread only; entries of requests that
        # already ended are skipped when popped.
        self._deadlines: list[tuple[float, int, str, Callable]] = []
        self._deadline_order = itertools.count()
        self.observers: list[Callable[[list[StreamDelta], dict[str, RequestOutput]], None]] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "AsyncLLM":
        if self._thread is None:
            # This thread loaded and warmed up the model: its idle OpenMP pools would make the
            # runtime stop spinning between the engine thread's parallel regions (see kvpage.platform.threads).
            release_thread_pools()
            self._thread = threading.Thread(target=self._run, name="kvpage-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: ``[0, vocab_size)``."""
        return self.engine.vocab_size

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort everything in flight, stop the loop, join the thread and close the engine."""
        if self._thread is None:
            return
        self._call(self._abort_all, "the server is shutting down")
        self._stop.set()
        self._commands.put(lambda: None)  # wake the loop
        self._thread.join(timeout_s)
        self._thread = None
        self.engine.close()  # the disk tier's queued writes reach the disk before we return

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        self.engine.adopt_current_thread()
        while not self._stop.is_set():
            self._drain_commands(block=not self.engine.has_unfinished_requests())
            self._finished_this_step = {}
            self._expire_deadlines()
            deltas = self._step() if not self._stop.is_set() and self.engine.has_unfinished_requests() else []
            self._stats = self.engine.stats()  # aborts and admissions change it even when idle
            if deltas or self._finished_this_step:
                self._notify(deltas)

    def _step(self) -> list[StreamDelta]:
        try:
            return self.engine.step()  # results reach their streams through the sinks
        except Exception as exc:  # noqa: BLE001 - keep serving: fail what was in flight, go on
            log.exception("engine step crashed")
            self._abort_all(f"engine error: {type(exc).__name__}: {exc}")
            return []

    def _notify(self, deltas: list[StreamDelta]) -> None:
        for observer in self.observers:
            try:
                observer(deltas, self._finished_this_step)
            except Exception:  # noqa: BLE001 - a metrics bug must not stop the engine thread
                log.exception("step observer failed")

    def _expire_deadlines(self) -> None:
        """End the requests past their deadline (``finish_reason == "length"``), freeing their blocks."""
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request_id, sink = heapq.heappop(self._deadlines)
            if self.engine.sink_of(request_id) is sink:  # not a later request reusing the id
                self.engine.abort_with_output(request_id, reason=FinishReason.LENGTH)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _sink(self, loop: asyncio.AbstractEventLoop, results: asyncio.Queue, request_id: str) -> Callable:
        """The engine-side end of one request's stream (called on the engine thread)."""

        def deliver(item: Any) -> None:
            if isinstance(item, RequestOutput):
                self._finished_this_step[request_id] = item
            try:
                loop.call_soon_threadsafe(results.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed: nobody can read this request
                self._commands.put(lambda: self.engine.abort_with_output(request_id, deliver=False))

        return deliver

    def _abort_all(self, message: str) -> None:
        for sink in self.engine.abort_all():
            if sink is not None:
                sink(RuntimeError(message))

    def _call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the engine thread; the future carries its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

        self._commands.put(command)
        return future

    # ------------------------------------------------------------------ public API
    async def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                          request_id: Optional[str] = None, timeout_s: Optional[float] = None) -> "RequestStream":
        """Validate and queue a request on the engine thread; return its result stream.

        ``timeout_s``: seconds from now after which the request ends with ``"length"``.
        Raises ``ValueError`` for bad input and ``QueueFullError`` when the waiting queue is full.
        """
        if not self.is_running:
            raise RuntimeError("the engine is not running")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout_s!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results: asyncio.Queue = asyncio.Queue()
        sink = self._sink(asyncio.get_running_loop(), results, request_id)

        def add() -> None:
            self.engine.add_request(prompt, params, request_id, sink=sink)
            if deadline is not None:
                heapq.heappush(self._deadlines, (deadline, next(self._deadline_order), request_id, sink))

        await asyncio.wrap_future(self._call(add))
        return RequestStream(self, request_id, results)

    async def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None,
                       timeout_s: Optional[float] = None) -> AsyncIterator[Union[StreamDelta, RequestOutput]]:
        """``add_request`` then iterate its stream (see the module docstring)."""
        stream = await self.add_request(prompt, params, request_id, timeout_s)
        async for item in stream:
            yield item

    def _abort_on_thread(self, request_id: str) -> bool:
        # The sink receives the aborted output, so a consumer other than the aborter is
        # never left waiting forever.
        return self.engine.abort(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Abort from any thread; takes effect before the engine's next step."""
        self._call(self._abort_on_thread, request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its stream ends with a final output (``finish_reason == "abort"``)."""
        return await asyncio.wrap_future(self._call(self._abort_on_thread, request_id))

    def stats(self) -> dict:
        """Engine statistics as of the last step (safe to read from any thread)."""
        return dict(self._stats)

    async def cached_block_hashes(self, max_blocks: Optional[int] = None) -> list[int]:
        """Chained hashes of the blocks in the prefix cache (``RadixCache.block_hashes``), read on the
        engine thread; empty without prefix caching."""
        return await asyncio.wrap_future(self._call(self.engine.cached_block_hashes, max_blocks))

    async def fresh_stats(self) -> dict:
        """Statistics read on the engine thread right now."""
        return await asyncio.wrap_future(self._call(self.engine.stats))


class RequestStream:
    """Results of one request: ``StreamDelta`` items, then the final ``RequestOutput``.

    Leaving the iteration early (break, cancellation, a disconnected client) aborts the
    request so its KV blocks return to the pool.
    """

    def __init__(self, llm: AsyncLLM, request_id: str, results: asyncio.Queue) -> None:
        self.llm = llm
        self.request_id = request_id
        self._results = results
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[Union[StreamDelta, RequestOutput]]:
        try:
            while not self.finished:
                item = await self._results.get()
                if isinstance(item, Exception):
                    self.finished = True
                    raise item
                if isinstance(item, RequestOutput):
                    self.finished = True
                yield item
        finally:
            if not self.finished:
                self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.llm.abort_nowait(self.request_id)
