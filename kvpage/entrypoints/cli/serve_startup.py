"""What ``kvpage serve`` does between parsing its flags and serving requests.

In order: configure the ``kvpage`` logger, check the port is free, load the model and
build the engine, log what was chosen (model, dtype, device, threads, KV blocks and bytes
and the sizing rule that chose them), warn about flags that do not apply to the device,
run a warm-up forward (first-use compilation happens here, not in the first request),
and only then start uvicorn, so ``/health`` answers only once the engine is warm.

Start-up failures are one line on stderr and exit status 1; ``--log-level debug`` raises
them with their traceback instead.
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys
import time
from typing import Any

from kvpage.core.config import EngineConfig
from kvpage.entrypoints.openai.startup import engine_summary, warm_up
from kvpage.storage.sizing import kv_sizing_rule

log = logging.getLogger("kvpage")


class StartupError(RuntimeError):
    """The server cannot start for a reason the user can fix (exit status 1)."""


def configure_logging(level: str) -> None:
    """One stderr handler on the ``kvpage`` logger, at ``level`` (idempotent)."""
    log.setLevel(level.upper())
    if not any(getattr(h, "_kvpage", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
        handler._kvpage = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.propagate = False


def check_port_free(host: str, port: int) -> None:
    """Raise ``StartupError`` if ``host:port`` cannot be bound (checked before the slow model load)."""
    if port == 0:
        return
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def device_warnings(explicit: set[str], device_type: str, config: EngineConfig) -> list[str]:
    """Warnings for flags given on the command line that have no effect on ``device_type``."""
    if "gpu_memory_utilization" not in explicit:
        return []
    rule = kv_sizing_rule(config.num_kv_blocks, config.kv_cache_memory, device_type)
    if device_type != "cuda":
        return [f"--gpu-memory-utilization does not apply on {device_type}: KV blocks are sized by the {rule} rule "
                "(use --kv-cache-memory or --num-kv-blocks to size them)"]
    if rule != "GPU profile":
        return [f"--gpu-memory-utilization is ignored: the {rule} rule sizes the KV cache"]
    return []


def serve(args: argparse.Namespace, model: str, config: EngineConfig) -> int:
    """Start, serve until Ctrl-C or SIGTERM, stop; returns the exit status."""
    configure_logging(args.log_level)
    try:
        check_port_free(args.host, args.port)
        llm = _start_engine(args, model, config)
    except KeyboardInterrupt:
        print("kvpage serve: interrupted during start-up", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - every start-up failure is reported the same way
        if args.log_level == "debug":
            raise
        print(f"kvpage serve: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    return _run_http(args, model, llm)


def _start_engine(args: argparse.Namespace, model: str, config: EngineConfig) -> Any:
    from kvpage.entrypoints.llm import LLM

    log.info("loading %s ...", model)
    start = time.perf_counter()
    llm = LLM(model, config=config)
    built = time.perf_counter() - start
    for line in engine_summary(llm, config):
        log.info("%s", line)
    for warning in device_warnings(getattr(args, "explicit", set()), llm.device.type, config):
        log.warning("%s", warning)
    warmed = warm_up(llm)
    compiled = llm.runner.compiled
    log.info("ready in %.1f s: engine built in %.1f s%s, warm-up %.1f s",
             time.perf_counter() - start, built,
             "" if compiled is None else f" (compiling the forward: {compiled.compile_seconds:.1f} s)", warmed)
    return llm


def _run_http(args: argparse.Namespace, model: str, llm: Any) -> int:
    import uvicorn

    from kvpage.engine.async_llm import AsyncLLM
    from kvpage.entrypoints.openai.app import build_app

    names = args.served_model_name or [model]
    async_llm = AsyncLLM(llm.engine).start()
    app = build_app(async_llm, llm.tokenizer, names, llm.max_model_len,
                    api_key=args.api_key, max_body_bytes=args.max_body_bytes, max_tokens_cap=args.max_tokens_cap,
                    max_request_seconds=args.max_request_seconds, stats_interval_s=args.stats_interval_s)
    log.info("serving %s on http://%s:%d (stats every %s)", names[0], args.host, args.port,
             f"{args.stats_interval_s:g} s" if args.stats_interval_s else "never")
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the Ctrl-C it handled once it has shut down: not an error
    finally:
        async_llm.shutdown()  # idempotent: also covers a lifespan that was cancelled
    return 0


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (ValueError, OSError, StartupError)):
        return text
    return f"{type(exc).__name__}: {text} (--log-level debug shows the traceback)"
