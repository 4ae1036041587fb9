"""The PNG chart: per scenario, useful tokens/s, concurrency, and the ITL distribution.

Drawn with matplotlib's Agg backend (the ``bench`` extra installs it).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

COLORS = {"A": "#d62728", "B": "#ff7f0e", "C": "#1f77b4", "D": "#2ca02c", "E": "#9467bd"}


def panels(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per scenario: configs, tokens/s, max and mean concurrency, sorted ITL samples (ms)."""
    out = []
    for scenario in report["scenarios"]:
        rows = [r for r in scenario["results"] if r["status"] == "ok"]
        out.append({
            "name": scenario["name"], "configs": [r["config"] for r in rows],
            "throughput": [r["useful_tokens_per_s"] or 0.0 for r in rows],
            "max_conc": [r["max_concurrency"] or 0 for r in rows],
            "mean_conc": [r["mean_concurrency"] or 0.0 for r in rows],
            "itl": [np.sort(np.asarray(scenario["raw"][r["config"]]["itl_ms"])) for r in rows],
        })
    return out


def write_png(report: dict[str, Any], path: Path) -> str:
    """Draw the chart to ``path``; returns the renderer used."""
    import matplotlib

    matplotlib.use("Agg")
    _matplotlib(panels(report), path)
    return "matplotlib"


def _matplotlib(data: list[dict[str, Any]], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(data), 3, figsize=(15, 3.6 * len(data)), squeeze=False)
    for row, panel in zip(axes, data):
        colors = [COLORS.get(c, "grey") for c in panel["configs"]]
        row[0].bar(panel["configs"], panel["throughput"], color=colors)
        row[0].set_title(f"{panel['name']}: useful output tokens/s")
        x = np.arange(len(panel["configs"]))
        row[1].bar(x - 0.2, panel["max_conc"], 0.4, color=colors, label="max")
        row[1].bar(x + 0.2, panel["mean_conc"], 0.4, color=colors, alpha=0.45, label="mean")
        row[1].set_xticks(x, panel["configs"])
        row[1].set_title(f"{panel['name']}: concurrent sequences (max, mean)")
        for config, itl, color in zip(panel["configs"], panel["itl"], colors):
            if itl.size:
                row[2].plot(itl, np.linspace(0, 1, itl.size), color=color, label=config)
        row[2].set_xscale("log")
        row[2].set_xlabel("inter-token latency (ms)")
        row[2].set_title(f"{panel['name']}: ITL CDF")
        row[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
