"""The Markdown table (stdout) and the JSON report (every raw figure) of a suite run."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from kvpage.tools.bench.metrics import RunResult, itl_ms, summarize

COLUMNS = [  # (summary key, header, format)
    ("max_concurrency", "max conc. seqs", "{:d}"),
    ("kv_waste_pct", "KV waste %", "{:.1f}"),
    ("useful_tokens_per_s", "useful tok/s", "{:.1f}"),
    ("ttft_mean_ms", "TTFT mean ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT P99 ms", "{:.0f}"),
    ("itl_median_ms", "ITL P50 ms", "{:.1f}"),
    ("itl_p99_ms", "ITL P99 ms", "{:.1f}"),
    ("prefix_hit_pct", "prefix hit %", "{:.1f}"),
    ("num_preemptions", "preempt.", "{:d}"),
]
# Shown only for scenarios whose runs report them (the closed-loop multi-turn driver does).
OPTIONAL_COLUMNS = [
    ("ttft_later_turns_mean_ms", "TTFT later turns mean ms", "{:.0f}"),
    ("prompt_tokens_sent", "prompt tok sent", "{:d}"),
    ("prefill_tokens_computed", "prefill tok computed", "{:d}"),
    ("later_turn_prefill_tokens_computed", "prefill tok computed, later turns", "{:d}"),
]


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    return fmt.format(int(value) if fmt == "{:d}" else value)


def markdown(scenario: dict[str, Any]) -> str:
    """One scenario's results as a Markdown table; skipped configurations say why."""
    head = f"**{scenario['name']}** — {scenario['description']}; {scenario['num_requests']} requests, " \
           f"{scenario['useful_tokens']} useful tokens, {_arrivals(scenario)}"
    columns = COLUMNS + [c for c in OPTIONAL_COLUMNS if any(row.get(c[0]) is not None for row in scenario["results"])]
    lines = [head, "", "| config | " + " | ".join(h for _, h, _ in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for row in scenario["results"]:
        name = f"{row['config']}: {row['label']}"
        if row["status"] != "ok":
            lines.append(f"| {name} | {row['status']}: {_one_line(row['reason'])} |" + " |" * (len(columns) - 1))
            continue
        lines.append(f"| {name} | " + " | ".join(_cell(row.get(k), f) for k, _, f in columns) + " |")
    ratios = scenario.get("throughput_ratios")
    if ratios:
        lines += ["", "useful tok/s ratios: " + ", ".join(f"{pair} {value:.2f}x" for pair, value in ratios.items())]
    return "\n".join(lines)


def _one_line(reason: str) -> str:
    """A reason as one table cell: its first line, pipes escaped (the JSON keeps it whole)."""
    return (reason.strip().splitlines() or [""])[0].replace("|", "\\|")


#: The throughput ratios a scenario reports (numerator, denominator): the paged
#: configurations over HF static batching and over HF continuous batching.
RATIO_PAIRS = (("C", "A"), ("D", "A"), ("C", "B"), ("D", "B"))


def throughput_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``{"C/A": x, ...}``: useful tok/s of one configuration over another's, for every pair
    of ``RATIO_PAIRS`` whose two rows ran ("ok") with a positive rate."""
    rate = {row["config"]: row.get("useful_tokens_per_s") for row in rows if row["status"] == "ok"}
    return {f"{num}/{den}": rate[num] / rate[den] for num, den in RATIO_PAIRS
            if rate.get(num) and rate.get(den)}


def _arrivals(scenario: dict[str, Any]) -> str:
    if scenario.get("closed_loop"):
        return "closed loop (each turn sent when the previous one answered)"
    return "Poisson arrivals" if scenario["online"] else "all at t=0"


def scenario_entry(workload, results: list[RunResult], kv_budget_bytes: int) -> dict[str, Any]:
    """Summaries, consistency checks and raw samples of one scenario."""
    rows = [summarize(r) for r in results]
    for row in rows:
        rate = row.get("prefix_hit_rate")
        row["prefix_hit_pct"] = None if rate is None else 100.0 * rate
    ok = [r for r in results if r.status == "ok"]
    reference = _reference(ok)
    for row, result in zip(rows, results):
        if result.status == "ok" and reference is not None:
            row["greedy_match_pct"] = _match_pct(result, reference)
    return {
        "name": workload.name, "description": workload.description, "num_requests": len(workload.requests),
        "online": workload.is_online, "closed_loop": workload.closed_loop, "max_len": workload.max_len, "useful_tokens": workload.num_useful_tokens,
        "prompt_tokens": sum(len(r.prompt_ids) for r in workload.requests), "kv_budget_bytes": kv_budget_bytes,
        "useful_tokens_equal": len({row["useful_tokens"] for row in rows if row["status"] == "ok"}) <= 1,
        "greedy_reference": None if reference is None else reference.config,
        "throughput_ratios": throughput_ratios(rows),
        "results": rows, "raw": {r.config: _raw(r) for r in ok},
    }


def _reference(results: list[RunResult]) -> Optional[RunResult]:
    for config in ("C", "D", "E"):
        for r in results:
            if r.config == config:
                return r
    return results[0] if results else None


def _match_pct(result: RunResult, reference: RunResult) -> float:
    """Share of requests whose greedy tokens equal the reference configuration's, in %."""
    ref = {t.request_id: t.token_ids for t in reference.traces}
    same = sum(1 for t in result.traces if ref.get(t.request_id) == t.token_ids)
    return 100.0 * same / max(len(result.traces), 1)


def _raw(result: RunResult) -> dict[str, Any]:
    return {
        "concurrency_samples": result.concurrency_samples, "kv_waste_samples": result.kv_waste_samples,
        "itl_ms": [round(x, 3) for x in itl_ms(result).tolist()],
        "requests": [{"id": t.request_id, "arrival_s": t.arrival_s, "max_tokens": t.max_tokens,
                      "token_times_s": [round(x, 6) for x in t.token_times]} for t in result.traces],
    }


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=1, default=float), encoding="utf-8")
