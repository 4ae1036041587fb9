"""``kvpage serve``: the OpenAI-compatible server, taking vLLM's flags."""
from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Optional

from .core.config import EngineConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"4GiB"``, ``"512M"``, ``"1000000"`` -> bytes (binary multiples for K/M/G/T)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4GiB, 512M, 1000000)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * (1024 ** "_kmgt".index(unit) if unit else 1))


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", nargs="?", default="smollm2-135m", help="local HF folder or alias (default: SmolLM2)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU only; ignored on CPU")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV budget, e.g. 2GiB")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer <key> on /v1/*")
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--max-waiting", type=int, default=1024, help="waiting-queue bound; past it requests get 503")
    p.add_argument("--max-body-bytes", type=parse_bytes, default=1 << 20)
    p.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run_serve)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` named by the parsed flags (each flag is a field of the same name)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
                           if hasattr(args, f.name)})


def run_serve(args: argparse.Namespace) -> Optional[int]:
    import uvicorn

    from .async_engine import AsyncLLM
    from .llm import LLM
    from .server.app import build_app

    llm = LLM(args.model, config=config_from_args(args))
    names = args.served_model_name or [str(args.model)]
    async_llm = AsyncLLM(llm.engine).start()
    app = build_app(async_llm, llm.tokenizer, names, llm.engine.scheduler.config.max_model_len,
                    api_key=args.api_key, max_body_bytes=args.max_body_bytes, max_tokens_cap=args.max_tokens_cap)
    stats = llm.stats()
    print(f"kvpage: serving {names[0]} on http://{args.host}:{args.port} with {stats['num_blocks']} KV blocks "
          f"of {args.block_size} tokens", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the Ctrl-C it handled once it has shut down: not an error
    finally:
        async_llm.shutdown()  # idempotent: also covers a lifespan that was cancelled
    return 0
