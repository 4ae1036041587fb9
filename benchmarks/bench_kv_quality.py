"""Quality of each KV cache format: perplexity on Python's documentation prose, greedy agreement.

Run (prints a table and writes ``bench_out/bench_kv_quality.json``)::

    python benchmarks/bench_kv_quality.py                     # SmolLM2-135M, bf16, every format
    python benchmarks/bench_kv_quality.py --window 1024 --max-windows 16

Each format loads the model once (``LLM(model, kv_cache_dtype=F)``), scores the text's
windows through the engine's prompt log-probabilities (``kvpage.tools.kv_quality``), then
answers the demo's questions greedily; agreement is against the first format (the model's
dtype, ``auto``). Deterministic: no timing, so a busy machine changes nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4")


def demo_prompts(model: str, count: int) -> list[str]:
    """The demo's chat prompts (``kvpage demo``), rendered by the model's chat template."""
    from transformers import AutoTokenizer

    from kvpage.entrypoints.cli.demo import QUESTIONS, SYSTEM_PROMPT
    from kvpage.platform.model_registry import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    return [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                           {"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in QUESTIONS[:count]]


def format_table(rows: list[dict]) -> str:
    base = rows[0]["perplexity"]
    lines = ["| kv_cache_dtype | bytes/token | perplexity | vs first | greedy agreement | common prefix |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        agree = "-" if row["agreement"] is None else f"{row['agreement']:.0%}"
        prefix = "-" if row["common_prefix"] is None else f"{row['common_prefix']:.0%}"
        lines.append(f"| {row['kv_cache_dtype']} | {row['kv_bytes_per_token'] or '-'} | {row['perplexity']:.4f} | "
                     f"{(row['perplexity'] / base - 1) * 100:+.2f} % | {agree} | {prefix} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated kv_cache_dtype names")
    parser.add_argument("--window", type=int, default=1024, help="tokens per scored prompt")
    parser.add_argument("--max-windows", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16, help="demo questions for greedy agreement (0: none)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", default="bench_out/bench_kv_quality.json")
    args = parser.parse_args(argv)

    from kvpage.tools.kv_quality import measure_quality

    prompts = demo_prompts(args.model, args.prompts) if args.prompts else ()
    results = measure_quality(args.model, args.formats.split(","), dtype=args.dtype, window=args.window,
                              max_windows=args.max_windows, prompts=prompts, max_tokens=args.max_tokens,
                              max_model_len=max(2048, args.window + 64))
    rows = [{k: v for k, v in vars(r).items() if k != "continuations"} for r in results]
    print(f"{args.model} ({args.dtype}), {rows[0]['tokens']} scored tokens in windows of {args.window}")
    print(format_table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "window": args.window, "rows": rows},
                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
