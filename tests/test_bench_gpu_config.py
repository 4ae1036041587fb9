"""The GPU end-to-end bench step (``benchmarks/gpu_check.sh``, step 6), checked without a GPU.

The step runs ``kvpage bench`` with the script's ``bench_args`` line on a random bf16
Llama-3-8B on CUDA. Here: the model's shape builds on the meta device with Llama-3-8B's
parameter count and KV bytes; that command line parses and, without CUDA, refuses in one
line with exit code 2 before building anything; and the same line with a tiny model on CPU
produces the A/B/C/D rows and their throughput ratios; a failed configuration gets a row
without losing the others, and a machine without matplotlib still gets the JSON and Markdown.
"""
from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpage.entrypoints.cli.main import main  # noqa: E402
from kvpage.tools.bench import model as model_mod, workload as wl  # noqa: E402
from kvpage.tools.bench.runners import CONFIGS  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"


def script_bench_args() -> list[str]:
    """The ``bench_args=(...)`` array of gpu_check.sh, as argv words."""
    match = re.search(r"^bench_args=\(([^)]*)\)$", SCRIPT.read_text(encoding="utf-8"), re.MULTILINE)
    assert match, "gpu_check.sh has no bench_args=(...) line"
    return shlex.split(match.group(1))


def on_cpu(args: list[str]) -> list[str]:
    """``args`` with the device, model and scale swapped for a tiny CPU run; the rest as is."""
    swap = {"--device": "cpu", "--model": "random-tiny", "--scale": "tiny"}
    out = list(args)
    for flag, value in swap.items():
        out[out.index(flag) + 1] = value
    return out


def test_llama3_8b_shape_builds_on_the_meta_device():
    loaded = model_mod.load("random-llama3-8b", 0, "meta")
    config = loaded.model.config
    assert loaded.num_params == 8_030_261_248  # Llama-3-8B: 8.03B parameters
    assert loaded.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    assert loaded.vocab_size == 128256
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size) == (4096, 32, 32, 8, 14336)
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.max_position_embeddings == 8192
    assert {p.device.type for p in loaded.model.parameters()} == {"meta"}
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}  # "auto" off the CPU


def test_script_command_line_parses_and_refuses_without_cuda(monkeypatch, capsys, tmp_path):
    from kvpage.entrypoints.cli.main import build_parser

    args = script_bench_args()
    parsed = build_parser().parse_args(["bench", *args])
    assert (parsed.device, parsed.dtype, parsed.model, parsed.scale, parsed.configs, parsed.scenario) == (
        "cuda", "bfloat16", "random-llama3-8b", "gpu-check", "ABCD", ("sharegpt",))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvpage bench: error: --device cuda was asked for but no CUDA device is available"]
    assert not (tmp_path / "out").exists()  # refused before building or writing anything


def test_gpu_check_scale_fits_the_step():
    """64 ShareGPT-shaped requests at t=0, short outputs: sized for the step's two minutes."""
    workload = wl.build("sharegpt", wl.SCALES["gpu-check"], 128256, 0)
    assert len(workload.requests) == 64 and not workload.is_online
    assert workload.num_useful_tokens <= 4096 and workload.max_len <= 1024


def test_script_command_line_on_cpu_gives_the_abcd_rows(capsys, tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", *on_cpu(script_bench_args()), "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["model_dtype"] == "torch.bfloat16" and report["settings"]["device"] == "cpu"
    (scenario,) = report["scenarios"]
    rows = {row["config"]: row for row in scenario["results"]}
    assert list(rows) == ["A", "B", "C", "D"]
    assert {row["status"] for row in rows.values()} == {"ok"}
    assert {row["useful_tokens"] for row in rows.values()} == {scenario["useful_tokens"]}
    for letter in "CD":  # the paged configurations at A's bytes: less waste than its reserved slots
        assert rows[letter]["kv_waste_pct"] < rows["A"]["kv_waste_pct"]
        assert rows[letter]["itl_p99_ms"] is not None and rows[letter]["max_concurrency"] >= 1
    ratios = scenario["throughput_ratios"]
    assert set(ratios) == {"C/A", "D/A", "C/B", "D/B"}
    assert ratios["C/A"] == pytest.approx(rows["C"]["useful_tokens_per_s"] / rows["A"]["useful_tokens_per_s"])
    assert "useful tok/s ratios: C/A " in (out / "bench.md").read_text()
    assert not (out / "bench.partial.json").exists()


def test_a_failed_configuration_and_no_matplotlib_keep_the_report(monkeypatch, capsys, tmp_path):
    """C raises: its row says why in one table line, A's figures are kept (and were in the
    partial report before C ran), and the command exits 1. Without matplotlib (a bare GPU
    machine) the JSON and Markdown are still written, without a chart."""
    out, seen = tmp_path / "bench", {}

    def broken(ctx):
        seen.update(json.loads((out / "bench.partial.json").read_text()))
        raise RuntimeError("out of memory | on purpose\nsecond line")

    monkeypatch.setitem(CONFIGS, "C", (CONFIGS["C"][0], broken))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    args = on_cpu(script_bench_args())
    args[args.index("--configs") + 1] = "AC"
    assert main(["bench", *args, "--out", str(out)]) == 1
    assert seen["partial"] is True and [r["config"] for r in seen["scenarios"][0]["results"]] == ["A"]
    rows = {row["config"]: row for row in json.loads((out / "bench.json").read_text())["scenarios"][0]["results"]}
    assert rows["A"]["status"] == "ok" and rows["A"]["useful_tokens_per_s"] > 0
    assert rows["C"]["status"] == "failed" and rows["C"]["reason"].startswith("RuntimeError: out of memory")
    assert "| failed: RuntimeError: out of memory \\| on purpose |" in (out / "bench.md").read_text()
    assert "kvpage bench: failed: sharegpt C: RuntimeError: out of memory" in capsys.readouterr().err
    assert not (out / "bench.partial.json").exists()
    assert json.loads((out / "bench.json").read_text())["chart_renderer"] is None
    assert not (out / "bench.png").exists()
