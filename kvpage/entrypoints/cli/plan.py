"""``kvpage plan MODEL --max-model-len N``: the KV memory plan, without loading weights or allocating.

Prints, with and without the hybrid KV cache manager, each KV group's bytes per token and
blocks per request at ``N``, and the maximum concurrency the budget allows (``kvpage.storage.plan``),
for the KV format ``--kv-cache-dtype`` names; then every format side by side under the same
budget (bytes per token, blocks, maximum concurrency). ``--json`` prints all of it as JSON.
A budget that cannot hold one request at ``N`` is one line on stderr with the numbers (exit 1).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvpage.core.kv_formats import KV_CACHE_DTYPES
from kvpage.entrypoints.cli.args import UsageError, block_size, memory_share, positive_int
from kvpage.entrypoints.cli.serve import parse_bytes

_DTYPES = ("float32", "bfloat16", "float16")


def add_plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="KV memory per group, blocks per request and maximum concurrency "
                       "(hybrid on and off), from the model's config alone")
    p.add_argument("model", help="local HF model folder, alias, or a config.json file")
    p.add_argument("--max-model-len", type=positive_int, required=True, help="tokens per request to plan for")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV budget in bytes, e.g. 8GiB")
    budget.add_argument("--gpu-memory-utilization", type=memory_share, default=None,
                        help="share of the GPU for weights and KV (needs a visible GPU; activations are "
                             "not profiled, so the engine's figure is a little lower)")
    p.add_argument("--block-size", type=block_size, default=16, help="tokens per KV block (a power of two)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                   help="token budget of one step (a prefill chunk's size)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256, help="most sequences in one step")
    p.add_argument("--dtype", choices=_DTYPES, default="bfloat16", help="the model's dtype")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV cache format (auto: the model's dtype); every format is also shown side by side")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan_command, subparser=p)
    return p


def _load_config(model: str):
    from transformers import AutoConfig

    path = Path(model).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        return AutoConfig.from_pretrained(str(path.parent)) if path.name == "config.json" else \
            _config_from_json(path)
    from kvpage.platform.model_registry import resolve_model_path

    try:
        return AutoConfig.from_pretrained(str(resolve_model_path(model)))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _config_from_json(path: Path):
    from transformers import AutoConfig

    data = json.loads(path.read_text())
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise UsageError(f"{path}: no model_type")
    return AutoConfig.for_model(model_type, **data)


def _gpu_measurements(utilization: float, model: str) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--gpu-memory-utilization needs a visible GPU; give --kv-cache-memory instead")
    weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) if Path(model).is_dir() else 0
    return {"device": "cuda", "gpu_memory_utilization": utilization,
            "total_device_bytes": torch.cuda.get_device_properties(0).total_memory,
            "used_device_bytes": weights, "peak_activation_bytes": 0}


def run_plan_command(args: argparse.Namespace) -> int:
    from kvpage.adapters.config_spec import kv_spec_from_config, max_positions

    from kvpage.storage.plan import format_rows, memory_plan

    try:
        config = _load_config(args.model)
        positions = max_positions(config)
        if args.max_model_len > positions:  # the engine refuses it alike
            raise ValueError(f"max_model_len={args.max_model_len} exceeds the model's {positions} positions")
        spec = kv_spec_from_config(config, args.block_size, args.dtype)
        spec = dataclasses.replace(spec, kv_cache_dtype=args.kv_cache_dtype)
        measured = _gpu_measurements(args.gpu_memory_utilization, args.model) if args.gpu_memory_utilization else {}
        plan = memory_plan(spec, args.max_model_len, args.max_num_batched_tokens,
                           kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs, **measured)
        plan["formats"] = format_rows(spec, args.max_model_len, args.max_num_batched_tokens, plan["budget_bytes"],
                                      args.max_num_seqs)
    except ValueError as exc:
        print(f"kvpage plan: {exc}", file=sys.stderr)
        return 1
    plan["model"] = args.model
    print(json.dumps(plan, indent=2) if args.json else render_plan(plan))
    return 0


def render_plan(plan: dict) -> str:
    """The plan as a few aligned lines per layout."""
    lines = [f"KV plan for {plan['model']} at {plan['max_model_len']} tokens per request "
             f"(KV {plan['kv_format']}, {plan['bytes_per_token']} bytes per token; model {plan['dtype']}; blocks of "
             f"{plan['block_size']} tokens, budget {plan['budget_bytes'] / 2**30:.2f} GiB, {plan['sizing_rule']})"]
    for name in ("with_hybrid", "without_hybrid"):
        layout = plan[name]
        title = "hybrid KV groups" if name == "with_hybrid" else "one group (hybrid off)"
        if name == "with_hybrid" and not layout["hybrid"]:
            title += f": not hybrid ({layout['reason']})"
        lines.append(f"\n{title}: {layout['num_blocks']} blocks of {layout['bytes_per_block']} bytes")
        lines.append(f"  {'group':>5} {'window':>8} {'layers':>6} {'KV B/token':>11} {'blocks/request':>15}")
        for row in layout["groups"]:
            window = "full" if row["sliding_window"] is None else str(row["sliding_window"])
            lines.append(f"  {row['group']:>5} {window:>8} {row['num_layers']:>6} {row['kv_bytes_per_token']:>11} "
                         f"{row['blocks_per_request']:>15}")
        lines.append(f"  blocks per request: {layout['blocks_per_request']} "
                     f"({layout['blocks_per_request_while_prefilling']} while a prefill chunk runs); "
                     f"max concurrency: {layout['max_concurrency']}")
    if plan["concurrency_ratio"] is not None:
        lines.append(f"\nhybrid / one group: {plan['concurrency_ratio']:.2f}x the concurrent requests")
    if plan.get("formats"):
        lines.extend(render_formats(plan["formats"], plan["dtype"]))
    return "\n".join(lines)


def render_formats(rows: list, model_dtype: str) -> list:
    """Every KV format side by side (the plan's budget, the engine's default layout)."""
    lines = ["\nevery KV format under this budget (the engine's default layout):",
             f"  {'kv_cache_dtype':<15} {'bytes/token':>11} {'blocks':>8} {'tokens':>10} {'max concurrency':>15} "
             f"{'vs ' + model_dtype:>12}"]
    for row in rows:
        mark = "*" if row["selected"] else " "
        if "error" in row:
            why = row["error"] if len(row["error"]) <= 60 else row["error"][:57] + "..."
            size = row.get("bytes_per_token", "-")
            lines.append(f"{mark} {row['kv_cache_dtype']:<15} {size:>11} {'-':>8} {'-':>10} {'-':>15} {'':>12}  {why}")
            continue
        ratio = f"{row['capacity_ratio']:.2f}x" if row["capacity_ratio"] is not None else "-"
        lines.append(f"{mark} {row['kv_cache_dtype']:<15} {row['bytes_per_token']:>11} {row['num_blocks']:>8} "
                     f"{row['tokens']:>10} {row['max_concurrency']:>15} {ratio:>12}")
    return lines
