"""``kvpage census`` (every decoder family in transformers) and ``kvpage check MODEL`` (one local model).

Registered by ``kvpage.entrypoints.cli.main``. Heavy imports happen only when a command runs. A bad command
line is a usage error (exit 2); a model folder that cannot be loaded is one line on stderr
(exit 1). ``check`` exits 0 when kvpage serves the model exactly and 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from kvpage.entrypoints.cli.args import UsageError, non_negative_float


def add_census_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("census", help="classify every causal-LM family of the installed transformers "
                       "(exact / refused / mismatch / skipped) against HF generate")
    p.add_argument("--json", type=Path, default=None, help="write the results here (JSON)")
    p.add_argument("--markdown", type=Path, default=None, help="write the coverage page here (e.g. "
                   "docs/model_coverage.md)")
    p.add_argument("--families", default=None, help="comma list of model types (default: the whole registry)")
    p.add_argument("--from-json", type=Path, default=None, help="render --markdown from this census JSON "
                   "instead of running the census")
    p.add_argument("--timeout-s", type=non_negative_float, default=300.0,
                   help="seconds one family may take before its process is killed")
    p.set_defaults(func=run_census_command, subparser=p)
    return p


def add_check_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("check", help="does kvpage serve this local model exactly? (a short greedy probe "
                       "against HF generate)")
    p.add_argument("model", help="local Hugging Face model folder (config.json and weights) or an alias "
                   "(smollm2-135m: the embedded default model)")
    p.add_argument("--max-tokens", type=int, default=6, help="greedy tokens per probe prompt")
    p.add_argument("--json", type=Path, default=None, help="also write the report here (JSON)")
    p.set_defaults(func=run_check_command, subparser=p)
    return p


def _families(text: Optional[str]) -> Optional[list[str]]:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError("--families: give at least one model type")
    return names


def run_census_command(args: argparse.Namespace) -> int:
    from kvpage.tools.census.report import summary_line, to_markdown

    if args.from_json is not None:
        if args.markdown is None:
            raise UsageError("--from-json needs --markdown (the page to render)")
        census = _read_json(args.from_json)
    else:
        census = _run(_families(args.families), args.timeout_s)
        if args.json is not None:
            args.json.write_text(json.dumps(census, indent=1, sort_keys=True) + "\n")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(to_markdown(census))
    print(f"census: {summary_line(census)}")
    return 0


def _run(families: Optional[list[str]], timeout_s: float) -> dict:
    from kvpage.tools.census.runner import run_census

    def show(name: str, result: dict) -> None:
        reason = f"  {result['reason']}" if result["reason"] else ""
        print(f"{name:28s} {result['status']:9s}{reason}"[:240], flush=True)

    try:
        return run_census(families, timeout_s=timeout_s or 300.0, on_result=show)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _read_json(path: Path) -> dict:
    try:
        census = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--from-json: cannot read {path}: {exc}") from None
    if not isinstance(census, dict) or "families" not in census or "summary" not in census:
        raise UsageError(f"--from-json: {path} is not a census JSON (no 'families'/'summary')")
    return census


def run_check_command(args: argparse.Namespace) -> int:
    from kvpage.tools.census.check import check_model

    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        report = check_model(args.model, args.max_tokens)
    except ValueError as exc:
        print(f"kvpage check: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print("\n".join(report.lines()))
    if args.json is not None:
        args.json.write_text(json.dumps(vars(report), indent=1) + "\n")
    return 0 if report.status == "exact" else 1
