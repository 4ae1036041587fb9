"""``kvpage bench``: HF static vs HF continuous vs kvpage paged batching, in one command.

Registered by ``kvpage.entrypoints.cli.main`` through ``add_bench_parser(sub)``; ``python -m kvpage.tools.bench``
runs the same parser standalone. Heavy imports happen only when the command runs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from kvpage.core.kv_formats import KV_CACHE_DTYPES
from kvpage.tools.bench.model import DTYPES
from kvpage.tools.bench.workload import SCALES as WORKLOAD_SCALES, SCENARIOS
from kvpage.entrypoints.cli.args import block_size, non_negative_float, positive_float, positive_int

SCALES = ("auto", *WORKLOAD_SCALES)
LETTERS = "ABCDEFG"


def _scenarios(text: str) -> tuple:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names in ((), ("all",)):
        return SCENARIOS
    bad = [n for n in names if n not in SCENARIOS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown scenario {bad[0]!r}; choose from all, {', '.join(SCENARIOS)}")
    return names


def _configs(text: str) -> str:
    letters = text.strip().upper()
    if not letters or any(c not in LETTERS for c in letters) or len(set(letters)) != len(letters):
        raise argparse.ArgumentTypeError(f"configs must be distinct letters from {LETTERS}, got {text!r}")
    return "".join(c for c in LETTERS if c in letters)


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add = parser.add_argument
    add("--model", default=None, help="random-tiny|random-30m|random-50m|random-350m|random-llama3-8b (random "
        "weights built from a config on the device, nothing downloaded), a local HF folder or an alias such as "
        "smollm2-135m (default: random-30m on CPU, random-350m with --scale full)")
    add("--scenario", type=_scenarios, default=SCENARIOS,
        help="comma list of sharegpt, burst, shared-prefix, multi-turn, long-context, or all")
    add("--configs", type=_configs, default=None, help="letters to run on every scenario (default: per scenario; "
        "A=HF static, B=HF continuous, C=paged, D=+chunked prefill, E=+prefix cache, F=E+host and disk KV tiers, "
        "G=E without hybrid KV groups)")
    add("--scale", choices=SCALES, default="auto", help="workload size (auto: full on a GPU, cpu otherwise)")
    add("--quick", action="store_true", help="a smaller workload (scale 'quick'), for a fast look")
    add("--rate", type=non_negative_float, default=None, help="Poisson arrival rate, requests/s (0 = all at t=0)")
    add("--kv-budget-mb", type=positive_float, default=None, help="KV budget in MiB for every configuration "
        "(default: what --static-seqs sequences at the workload's max length take)")
    add("--static-seqs", type=positive_int, default=8, help="sequences the default KV budget holds at max length")
    add("--max-num-seqs", type=positive_int, default=64, help="cap on sequences per step for B-E")
    add("--token-budget", type=positive_int, default=None, help="tokens per step with chunked prefill "
        "(default 128 on CPU, 512 at full scale)")
    add("--block-size", type=block_size, default=16, help="KV block (page) size in tokens for B-E")
    add("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="KV cache format of the kvpage "
        "configurations C-G (auto: the model's dtype); the KV budget in bytes stays that of the model's dtype, "
        "so a quantized format holds more tokens")
    add("--seed", type=int, default=0)
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="cuda refuses (exit 2) where no CUDA "
        "device is available")
    add("--dtype", choices=DTYPES, default="auto", help="the model's dtype (auto: float32 on CPU, bfloat16 on a "
        "GPU for random models; a checkpoint's own dtype otherwise)")
    add("--out", type=Path, default=Path("bench_out"), help="folder for bench.json, bench.md and bench.png")
    add("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run_bench, subparser=parser)
    return parser


def add_bench_parser(sub) -> None:
    """Register ``bench`` on the ``kvpage`` subcommand parser."""
    configure(sub.add_parser("bench", help="benchmark HF static / HF continuous / kvpage paged batching"))


def _options(args: argparse.Namespace):
    import torch

    from kvpage.tools.bench.suite import SuiteOptions

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    scale = "quick" if args.quick else args.scale
    if scale == "auto":
        scale = "full" if device == "cuda" else "cpu"
    full = scale == "full"
    configs = {name: args.configs for name in SCENARIOS} if args.configs else None
    budget = None if args.kv_budget_mb is None else int(args.kv_budget_mb * 2**20)
    return SuiteOptions(model=args.model or ("random-350m" if full else "random-30m"), scenarios=args.scenario,
                        configs=configs, scale=scale, seed=args.seed, rate=args.rate, static_seqs=args.static_seqs,
                        kv_budget_bytes=budget, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                        max_num_seqs=args.max_num_seqs,
                        token_budget=args.token_budget or (512 if full else 128), device=device, dtype=args.dtype,
                        progress=not args.no_progress, out_dir=args.out)


def run_bench(args: argparse.Namespace) -> int:
    """Run the suite, print the Markdown tables, write the report files; 2 on bad input,
    1 when a configuration failed (its row says why; the others' figures are written)."""
    from kvpage.tools.bench.suite import failed_rows, markdown_report, run_suite

    try:
        result = run_suite(_options(args))
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"kvpage bench: error: {exc}", file=sys.stderr)
        return 2
    print(markdown_report(result))
    chart = (f"{args.out / 'bench.png'} ({result['chart_renderer']} chart)" if result["chart_renderer"]
             else "no chart (matplotlib is not installed)")
    print(f"\nwrote {args.out / 'bench.json'}, {args.out / 'bench.md'}, {chart} in {result['elapsed_s']:.0f} s")
    failures = failed_rows(result)
    for failure in failures:
        print(f"kvpage bench: failed: {failure}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = configure(argparse.ArgumentParser(prog="python -m kvpage.tools.bench", description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
