"""The bench chart: config names in the legend, a KV-waste panel, a title naming model and machine."""
from __future__ import annotations

from kvpage.tools.bench.chart import panels, title, write_png


def _row(config, label, waste):
    return {"config": config, "label": label, "status": "ok", "useful_tokens_per_s": 10.0, "max_concurrency": 4,
            "mean_concurrency": 2.5, "kv_waste_pct": waste}


REPORT = {
    "settings": {"model": "random-30m", "num_params": 26.1e6, "scale": "quick", "kv_budget_bytes": 18 << 20},
    "machine": {"cpu_model": "Some CPU", "usable_cpus": 2, "gpu": None},
    "scenarios": [{"name": "sharegpt", "results": [_row("A", "HF static batching", 87.0),
                                                    _row("B", "HF continuous batching", None),
                                                    {"config": "C", "label": "paged", "status": "skipped"}],
                   "raw": {"A": {"itl_ms": [3.0, 1.0, 2.0]}, "B": {"itl_ms": []}}}],
}


def test_panels_carry_labels_and_kv_waste():
    (panel,) = panels(REPORT)
    assert panel["configs"] == ["A", "B"] and panel["labels"] == ["HF static batching", "HF continuous batching"]
    assert panel["kv_waste"] == [87.0, None] and panel["itl"][0].tolist() == [1.0, 2.0, 3.0]


def test_title_names_model_scale_and_machine():
    text = title(REPORT)
    assert "random-30m (26M params)" in text and "scale quick" in text and "18.0 MiB" in text
    assert "Some CPU, 2 CPUs, no GPU" in text


def test_png_is_written(tmp_path):
    path = tmp_path / "bench.png"
    assert write_png(REPORT, path) == "matplotlib"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
