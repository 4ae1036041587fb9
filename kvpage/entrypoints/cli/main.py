"""``kvpage`` command line: ``demo``, ``serve``, ``bench``, ``census``, ``check`` and ``plan`` subcommands.

Heavy imports (torch, transformers, the server) happen inside each subcommand so that
``kvpage --help`` is instant.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from kvpage.entrypoints.cli.args import CLIParser, UsageError, positive_int


def _demo(args: argparse.Namespace) -> int:
    from kvpage.entrypoints.cli.demo import run_demo

    try:
        return run_demo(model=args.model, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                        compare_hf=not args.no_compare, dtype=args.dtype, exact=args.mode == "exact")
    except ValueError as exc:  # a model that cannot load or be served: one line, as serve and plan
        print(f"kvpage demo: {exc}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    from kvpage import __version__

    parser = CLIParser(prog="kvpage", description="Paged KV-cache serving for Hugging Face models")
    parser.add_argument("--version", action="version", version=f"kvpage {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CLIParser)
    demo = sub.add_parser("demo", help="run chat prompts through paged continuous batching and compare with HF")
    demo.add_argument("--model", default="smollm2-135m", help="local HF folder or alias (default: embedded SmolLM2)")
    demo.add_argument("--num-prompts", type=positive_int, default=12)
    demo.add_argument("--max-tokens", type=positive_int, default=48)
    demo.add_argument("--no-compare", action="store_true", help="skip the plain HF generate comparison")
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                      help="float32 (default) keeps greedy answers comparable with HF one prompt at a time")
    demo.add_argument("--mode", default="exact", choices=["exact", "fast"],
                      help="exact (default): eager with torch's linears, so every answer can match HF generate; "
                      "fast: the engine's default mode (compiled, oneDNN linears), to see how many still match")
    demo.set_defaults(func=_demo, subparser=demo)
    _add_optional_subcommands(sub)
    return parser


def _add_optional_subcommands(sub) -> None:
    """Subcommands that live in modules of their own register themselves here."""
    from kvpage.entrypoints.cli.bench import add_bench_parser
    from kvpage.entrypoints.cli.census import add_census_parser, add_check_parser
    from kvpage.entrypoints.cli.plan import add_plan_parser
    from kvpage.entrypoints.cli.serve import add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    add_census_parser(sub)
    add_check_parser(sub)
    add_plan_parser(sub)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one subcommand. A bad command line exits with status 2 and the usage of the
    subcommand it was meant for (not the top-level one)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(argv)
    command_parser = getattr(args, "subparser", parser)
    if unknown:
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.explicit = command_parser.explicit_dests(argv) if isinstance(command_parser, CLIParser) else set()
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        command_parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
