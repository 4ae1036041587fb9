"""Inter-token latency under arrivals: ``kvpage serve`` variants driven by one streaming client.

Run (prints a table and writes ``bench_out/bench_online_itl.json``)::

    python benchmarks/bench_online_itl.py --variant default= --variant step150=--max-step-ms,150 \\
        --variant tokens256=--max-num-batched-tokens,256

Each variant starts its own ``kvpage serve`` on 127.0.0.1 with the shared flags
(``--server-args``) plus its own, waits for ``/health``, and sends ``--num-prompts``
completions with random token-id prompts of ``--input-len`` tokens (the shape of vLLM's
``random`` dataset), ``--output-len`` tokens each with EOS ignored, at most
``--concurrency`` in flight. It records TTFT (request sent to first streamed token),
ITL (between a request's consecutive streamed chunks) and output tokens/s over the run.
The client and server share this machine's cores: compare variants within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from bench_vs_vllm import _start_server  # benchmarks/ is on sys.path when run as a script


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None}
    arr = np.asarray(values) * 1e3
    return {f"p{p}_ms": round(float(np.percentile(arr, p)), 1) for p in (50, 90, 99)}


async def _drive(port: int, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    itl: list[float] = []
    tokens = [0]

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        body = {"model": "kvpage", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                "stream": True, "ignore_eos": True}
        async with gate:
            start = last = time.perf_counter()
            first = True
            async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    (ttft if first else itl).append(now - (start if first else last))
                    first, last = False, now
                    tokens[0] += 1

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        wall = time.perf_counter() - start
    return {"output_tok_per_s": round(tokens[0] / wall, 1), "chunks": tokens[0], "wall_s": round(wall, 1),
            "ttft": _percentiles(ttft), "itl": _percentiles(itl)}


def run_variant(name: str, flags: list[str], args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    kvpage = Path(sys.executable).with_name("kvpage")
    cmd = [str(kvpage), "serve", args.model, "--port", str(args.port), "--served-model-name", "kvpage",
           *args.server_args.split(), *flags]
    proc = _start_server(cmd, None, args.port)  # the vs-vLLM benchmark's launcher: waits for /health
    try:
        result = asyncio.run(_drive(args.port, prompts, args.output_len, args.concurrency))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"variant": name, "flags": flags, **result}


def add_workload_args(parser: argparse.ArgumentParser, port: int, out: str) -> None:
    """The model, server flags and random-prompt workload options this script and
    ``step_timeline.py`` share (``random_prompts`` draws the prompts)."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--server-args", default="", help="flags every server gets (space-separated)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=40000, help="random prompt ids are drawn below this")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(out))


def random_prompts(args: argparse.Namespace) -> list[list[int]]:
    """``--num-prompts`` prompts of ``--input-len`` token ids drawn from ``[100, --vocab)``."""
    rng = np.random.default_rng(args.seed)
    return [rng.integers(100, args.vocab, size=args.input_len).tolist() for _ in range(args.num_prompts)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(parser, port=8123, out="bench_out/bench_online_itl.json")
    parser.add_argument("--variant", action="append", default=None,
                        help="NAME=FLAG,VALUE,... (repeatable; default: one variant with no extra flags)")
    args = parser.parse_args(argv)
    prompts = random_prompts(args)
    variants = []
    for spec in args.variant or ["default="]:
        name, _, flags = spec.partition("=")
        variants.append((name, [f for f in flags.split(",") if f]))
    rows = [run_variant(name, flags, args, prompts) for name, flags in variants]
    print(f"{'variant':<12} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p90':>8} {'ITL p99':>8}")
    for r in rows:
        print(f"{r['variant']:<12} {r['output_tok_per_s']:>7} {r['ttft']['p50_ms']:>9} {r['ttft']['p99_ms']:>9} "
              f"{r['itl']['p50_ms']:>8} {r['itl']['p90_ms']:>8} {r['itl']['p99_ms']:>8}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"workload": {k: getattr(args, k) for k in (
        "model", "server_args", "num_prompts", "input_len", "output_len", "concurrency", "seed")}, "rows": rows},
        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
