"""``benchmarks/gpu_check.sh`` and its report writer, checked without a GPU.

The script itself runs only on a GPU machine; here its syntax is checked, and the report
writer (``benchmarks/gpu_check_report.py``) runs in its no-GPU mode: it must write the JSON
with every key and no figures (nothing was measured), and the Markdown next to it.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_script_parses() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    proc = subprocess.run([bash, "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_report_without_gpu_writes_keys_and_no_figures(tmp_path: Path) -> None:
    # -P: the repository root stays off sys.path, as in gpu_check.sh (PYTHONSAFEPATH=1).
    proc = subprocess.run([sys.executable, "-P", str(ROOT / "benchmarks" / "gpu_check_report.py"), str(tmp_path),
                           "--no-gpu"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {"device", "date", "commit", "host_us_per_decode_step", "rows"} <= set(report)
    assert report["device"] is None and report["host_us_per_decode_step"] is None
    assert report["rows"] == [] and report["mismatches"] == []
    assert report["skipped"]
    assert (tmp_path / "gpu_check.md").read_text().startswith("# gpu_check: n/a")


def test_report_rows_carry_the_documented_fields() -> None:
    """The row fields the report writer fills and its docstring promises stay in step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check_report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    doc = gpu_check_report.__doc__
    for field in ("batch", "context", "dtype", "kernel", "frac_peak", "sdpa_frac_peak", "host_us_per_decode_step"):
        assert f'"{field}"' in doc, field
    row = {"batch": 32, "context": 2048, "dtype": "fp16", "kernel": "fast", "kernel_us": 1.0, "frac_peak": 0.5,
           "sdpa_frac_peak": None}
    report = dict(gpu_check_report.base_report("GPU"), rows=[row])
    assert "| 32 | 2048 | fp16 | fast |" in gpu_check_report.markdown(report)


def test_decode_step_host_benchmark_skips_cleanly_without_a_gpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: gpu_check.sh runs the benchmark for real")
    proc = subprocess.run([sys.executable, "-P", str(ROOT / "benchmarks" / "decode_step_host.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("SKIP decode step host time")
    assert not (tmp_path / "decode_step_host.json").exists()
