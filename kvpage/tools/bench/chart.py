"""The PNG chart: one row per scenario, four labelled panels each.

(a) useful output tokens/s, (b) concurrent sequences (bar: max, diamond: mean), (c) KV
waste % (reserved token slots holding no token; "n/a" where a configuration exposes
none), (d) the inter-token latency CDF on a log axis. One legend names every
configuration; the title names the model, the workload scale and the machine. Drawn with
matplotlib's Agg backend (the ``bench`` extra installs it).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

COLORS = {"A": "#d62728", "B": "#ff7f0e", "C": "#1f77b4", "D": "#2ca02c", "E": "#9467bd", "F": "#8c564b"}


def panels(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per scenario: configs and their labels, tokens/s, max and mean concurrency, KV waste %
    (None where not measured) and sorted ITL samples (ms)."""
    out = []
    for scenario in report["scenarios"]:
        rows = [r for r in scenario["results"] if r["status"] == "ok"]
        out.append({
            "name": scenario["name"], "configs": [r["config"] for r in rows], "labels": [r["label"] for r in rows],
            "throughput": [r["useful_tokens_per_s"] or 0.0 for r in rows],
            "max_conc": [r["max_concurrency"] or 0 for r in rows],
            "mean_conc": [r["mean_concurrency"] or 0.0 for r in rows],
            "kv_waste": [r.get("kv_waste_pct") for r in rows],
            "itl": [np.sort(np.asarray(scenario["raw"][r["config"]]["itl_ms"])) for r in rows],
        })
    return out


def title(report: dict[str, Any]) -> str:
    """Model, scale, KV budget and machine, for the chart's title."""
    s, m = report.get("settings", {}), report.get("machine", {})
    params = f" ({s['num_params'] / 1e6:.0f}M params)" if s.get("num_params") else ""
    budget = f", KV budget {s['kv_budget_bytes'] / 2**20:.1f} MiB" if s.get("kv_budget_bytes") else ""
    gpu = (m.get("gpu") or {}).get("name") or "no GPU"
    return (f"kvpage bench: model {s.get('model', '?')}{params}, scale {s.get('scale', '?')}{budget}\n"
            f"{m.get('cpu_model', '?')}, {m.get('usable_cpus', '?')} CPUs, {gpu}")


def write_png(report: dict[str, Any], path: Path) -> str:
    """Draw the chart to ``path``; returns the renderer used."""
    import matplotlib

    matplotlib.use("Agg")
    _draw(report, panels(report), path)
    return "matplotlib"


def _draw(report: dict[str, Any], data: list[dict[str, Any]], path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(data), 4, figsize=(18, 3.4 * len(data) + 1.6), squeeze=False)
    for row, panel in zip(axes, data):
        colors = [COLORS.get(c, "grey") for c in panel["configs"]]
        _throughput(row[0], panel, colors)
        _concurrency(row[1], panel, colors)
        _waste(row[2], panel, colors)
        _itl(row[3], panel, colors)
    names = {}
    for panel in data:
        names.update(zip(panel["configs"], panel["labels"]))
    handles = [Patch(color=COLORS.get(c, "grey"), label=f"{c}: {names[c]}") for c in sorted(names)]
    handles.append(Line2D([], [], marker="D", color="black", linestyle="none", label="mean concurrency"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=10, frameon=False)
    fig.suptitle(title(report), fontsize=12)
    fig.tight_layout(rect=(0, 0.06, 1, 0.94))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _bars(ax, panel: dict, values: list, colors: list, heading: str, ylabel: str) -> None:
    ax.bar(panel["configs"], values, color=colors)
    ax.set_title(f"{panel['name']}: {heading}", fontsize=10)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def _throughput(ax, panel: dict, colors: list) -> None:
    _bars(ax, panel, panel["throughput"], colors, "(a) useful output tokens/s", "tokens/s")


def _concurrency(ax, panel: dict, colors: list) -> None:
    _bars(ax, panel, panel["max_conc"], colors, "(b) concurrent sequences", "sequences (bar: max)")
    ax.plot(panel["configs"], panel["mean_conc"], "D", color="black", markersize=6)


def _waste(ax, panel: dict, colors: list) -> None:
    values = [v if v is not None else 0.0 for v in panel["kv_waste"]]
    _bars(ax, panel, values, colors, "(c) KV waste", "% of reserved slots empty")
    ax.set_ylim(0, 100)
    for x, v in enumerate(panel["kv_waste"]):
        ax.annotate("n/a" if v is None else f"{v:.0f}", (x, values[x]), ha="center", va="bottom", fontsize=9)


def _itl(ax, panel: dict, colors: list) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for config, itl, color in zip(panel["configs"], panel["itl"], colors):
        if itl.size:
            ax.plot(itl, np.linspace(0, 1, itl.size), color=color, label=config)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("inter-token latency (ms, log scale)")
    ax.set_ylabel("fraction of tokens")
    ax.set_title(f"{panel['name']}: (d) ITL CDF", fontsize=10)
    ax.grid(alpha=0.3)
