"""``kv_cache_dtype`` on the command line: ``kvpage plan`` per format and side by side, and
``serve``/``bench``/``plan`` refusing a bad name with one line.

Byte and block counts are exact: they follow from each format's bytes per row
(``kvpage.core.kv_formats``) and the engine's sizing rule.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from kvpage.core.kv_formats import KV_CACHE_DTYPES
from kvpage.entrypoints.cli.main import main
from kvpage.storage.plan import PLAN_FORMATS
from kvpage.storage.spec import KVCacheSpec

GIB = 1 << 30


@pytest.mark.parametrize("command", ["serve", "bench", "plan"])
def test_the_cli_refuses_a_bad_name_with_usage(command, capsys, tmp_path):
    argv = {"serve": ["serve", "--kv-cache-dtype", "int2"],
            "bench": ["bench", "--kv-cache-dtype", "int2"],
            "plan": ["plan", str(tmp_path), "--max-model-len", "64", "--kv-cache-dtype", "int2"]}[command]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --kv-cache-dtype: invalid choice: 'int2'" in err and "fp8_e5m2" in err


def test_the_cli_error_is_one_line_in_a_fresh_process(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvpage", "plan", str(tmp_path), "--max-model-len", "64",
                           "--kv-cache-dtype", "int2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "--kv-cache-dtype: invalid choice: 'int2'" in errors[0], proc.stderr


def test_serve_flags_reach_the_engine_config():
    from kvpage.entrypoints.cli.main import build_parser
    from kvpage.entrypoints.cli.serve import config_from_args

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e5m2"])
    assert config_from_args(args).kv_cache_dtype == "fp8_e5m2"
    assert config_from_args(build_parser().parse_args(["serve"])).kv_cache_dtype == "auto"


def test_bench_passes_the_format_to_the_paged_configurations():
    from kvpage.tools.bench.runners.common import RunContext
    from kvpage.tools.bench.runners.paged import engine_config

    ctx = RunContext(workload=_FakeWorkload(), loaded=_FakeLoaded(), kv_budget_bytes=1 << 20, kv_cache_dtype="int4")
    assert engine_config(ctx, "E").kv_cache_dtype == "int4"
    assert engine_config(dataclasses.replace(ctx, kv_cache_dtype="auto"), "D").kv_cache_dtype == "auto"


@dataclasses.dataclass
class _FakeLoaded:
    kv_bytes_per_token: int = 1024


@dataclasses.dataclass
class _FakeWorkload:
    max_len: int = 100



# ---------------------------------------------------------------------- plan
@pytest.fixture(scope="module")
def smollm2_config(tmp_path_factory):
    """SmolLM2-135M's shape: 30 layers, 9 query and 3 KV heads of 64."""
    import transformers as tf

    folder = tmp_path_factory.mktemp("smollm2-shape")
    tf.LlamaConfig(vocab_size=96, hidden_size=576, intermediate_size=64, num_hidden_layers=30, num_attention_heads=9,
                   num_key_value_heads=3, max_position_embeddings=8192).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_plan_json_for_each_format(smollm2_config, capsys, name):
    budget, max_len = GIB, 2048
    assert main(["plan", str(smollm2_config), "--max-model-len", str(max_len), "--kv-cache-memory", "1GiB",
                 "--kv-cache-dtype", name, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    spec = KVCacheSpec.uniform(30, 3, 64, 16, "bfloat16", name)
    blocks = budget // spec.bytes_per_block
    assert plan["kv_cache_dtype"] == name and plan["kv_format"] == spec.kv_format.name
    assert plan["bytes_per_token"] == spec.bytes_per_token and plan["block_size"] == 16
    for layout in ("with_hybrid", "without_hybrid"):  # today's fields, for this format
        assert plan[layout]["num_blocks"] == blocks
        assert plan[layout]["max_concurrency"] == blocks // (max_len // 16)
    rows = {row["kv_cache_dtype"]: row for row in plan["formats"]}
    assert list(rows) == list(PLAN_FORMATS)
    assert [n for n, row in rows.items() if row["selected"]] == [spec.kv_format.name]
    for fmt, row in rows.items():  # side by side at the same budget
        other = KVCacheSpec.uniform(30, 3, 64, 16, "bfloat16", fmt)
        assert row["bytes_per_token"] == other.bytes_per_token
        assert row["num_blocks"] == budget // other.bytes_per_block and row["tokens"] == 16 * row["num_blocks"]
    assert rows["int4"]["capacity_ratio"] >= 3.2 and rows["fp8_e4m3"]["capacity_ratio"] >= 1.95


def test_plan_text_shows_every_format_side_by_side(smollm2_config, capsys):
    assert main(["plan", str(smollm2_config), "--max-model-len", "2048", "--kv-cache-memory", "1GiB",
                 "--kv-cache-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert "KV int8, 11880 bytes per token" in out
    table = out[out.index("every KV format"):].splitlines()[2:]
    cells = [line.lstrip("* ").split() for line in table]
    assert [row[0] for row in cells] == list(PLAN_FORMATS)
    selected = [line.split() for line in table if line.startswith("*")]
    assert len(selected) == 1 and selected[0][1:3] == ["int8", "11880"]
    bf16 = next(row for row in cells if row[0] == "bfloat16")
    assert bf16[1:] == ["23040", str(GIB // (16 * 23040)), str(16 * (GIB // (16 * 23040))),
                        str(GIB // (16 * 23040) // 128), "1.00x"]


def test_plan_marks_a_format_the_model_cannot_take(tmp_path, capsys):
    import transformers as tf

    tf.GPT2Config(vocab_size=96, n_embd=60, n_layer=2, n_head=4, n_positions=512).save_pretrained(tmp_path)  # heads of 15
    assert main(["plan", str(tmp_path), "--max-model-len", "256", "--kv-cache-memory", "64MiB", "--json"]) == 0
    rows = {row["kv_cache_dtype"]: row for row in json.loads(capsys.readouterr().out)["formats"]}
    assert "even head size" in rows["int4"]["error"] and rows["int8"]["bytes_per_token"] == 2 * 2 * 4 * 17
    assert main(["plan", str(tmp_path), "--max-model-len", "256", "--kv-cache-dtype", "int4"]) == 1
    assert capsys.readouterr().err.startswith("kvpage plan: layer 0: kv_cache_dtype int4")
