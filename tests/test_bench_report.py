"""Smoke test of ``kvpage bench`` on a tiny random model and workload (a few seconds).

Checks the report's structure and basic truths every run must satisfy: paged KV waste
below static's, equal useful tokens across configurations, prefix-cache hits for E on
the shared-prefix scenario, a non-empty PNG.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpage.tools.bench.suite import SuiteOptions, run_suite  # noqa: E402

SUMMARY_KEYS = {"config", "label", "status", "useful_tokens", "useful_tokens_per_s", "max_concurrency",
                "kv_waste_pct", "ttft_mean_ms", "ttft_p99_ms", "itl_median_ms", "itl_p99_ms", "prefix_hit_rate",
                "num_preemptions"}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    configs = {"sharegpt": "ABCDE", "shared-prefix": "ADE"}
    opts = SuiteOptions(model="random-tiny", scenarios=("sharegpt", "shared-prefix"), configs=configs,
                        scale="tiny", progress=False, out_dir=out, token_budget=16)
    run_suite(opts)
    return out, json.loads((out / "bench.json").read_text())


def _rows(report: dict, scenario: str) -> dict:
    (entry,) = [s for s in report["scenarios"] if s["name"] == scenario]
    return {row["config"]: row for row in entry["results"]}


def test_report_structure(bench_run):
    _, report = bench_run
    assert report["format"] == "kvpage-bench/1"
    assert {"cpu_model", "logical_cpus", "torch", "gpu"} <= set(report["machine"])
    assert report["settings"]["kv_budget_bytes"] > 0
    for scenario in report["scenarios"]:
        assert {"name", "results", "raw", "useful_tokens", "kv_budget_bytes"} <= set(scenario)
        for row in scenario["results"]:
            if row["status"] == "skipped":  # only HF's CB may be unavailable, and then with a reason
                assert row["config"] == "B" and row["reason"]
                continue
            assert SUMMARY_KEYS <= set(row)
            assert row["useful_tokens_per_s"] > 0 and row["max_concurrency"] >= 1
            assert len(scenario["raw"][row["config"]]["requests"]) == scenario["num_requests"]


def test_useful_tokens_equal_across_configurations(bench_run):
    _, report = bench_run
    for scenario in report["scenarios"]:
        counts = {row["useful_tokens"] for row in scenario["results"] if row["status"] == "ok"}
        assert counts == {scenario["useful_tokens"]}
        assert scenario["useful_tokens_equal"]


def test_paged_waste_below_static(bench_run):
    _, report = bench_run
    rows = _rows(report, "sharegpt")
    for config in "CDE":
        assert rows[config]["kv_waste_pct"] < rows["A"]["kv_waste_pct"]


def test_prefix_cache_hits_on_shared_prefix(bench_run):
    _, report = bench_run
    rows = _rows(report, "shared-prefix")
    assert rows["E"]["prefix_hit_rate"] > 0
    assert rows["D"]["prefix_hit_rate"] is None  # prefix caching is off in D


def test_outputs_written(bench_run):
    out, _ = bench_run
    assert (out / "bench.png").stat().st_size > 0
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| config |" in (out / "bench.md").read_text()


def test_bad_cli_input_is_a_clear_error(capsys):
    from kvpage.entrypoints.cli.bench import main

    with pytest.raises(SystemExit) as exc:
        main(["--scenario", "nope"])
    assert exc.value.code == 2
    assert "unknown scenario 'nope'" in capsys.readouterr().err
    for argv, message in ((["--kv-budget-mb", "0"], "--kv-budget-mb"), (["--block-size", "7"], "power of two")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_multi_turn_scenario_with_the_tiered_cache(tmp_path):
    """Closed-loop conversations: F (E + host and disk tiers) computes fewer prefill tokens
    than E for the same greedy tokens; A is skipped with its reason."""
    opts = SuiteOptions(model="random-tiny", scenarios=("multi-turn",), configs={"multi-turn": "AEF"}, scale="tiny",
                        progress=False, out_dir=tmp_path, token_budget=16, block_size=4)
    report = run_suite(opts)
    rows = _rows(report, "multi-turn")
    assert rows["A"]["status"] == "skipped" and "closed-loop" in rows["A"]["reason"]
    assert rows["E"]["useful_tokens"] == rows["F"]["useful_tokens"] == report["scenarios"][0]["useful_tokens"]
    assert rows["F"]["greedy_match_pct"] == 100.0  # against E: the tiers change nothing but the cost
    assert rows["F"]["prompt_tokens_sent"] == rows["E"]["prompt_tokens_sent"]
    assert rows["F"]["later_turn_prefill_tokens_computed"] < rows["E"]["later_turn_prefill_tokens_computed"]
    assert rows["F"]["kv_host_hit_tokens"] > 0
    assert "TTFT later turns mean ms" in (tmp_path / "bench.md").read_text()


def test_long_context_scenario_compares_hybrid_on_and_off(tmp_path):
    """On its own Gemma3-pattern model, E (hybrid KV groups) fits more long requests at once
    than G (hybrid off) in the same bytes."""
    opts = SuiteOptions(model="random-tiny", scenarios=("long-context",), scale="tiny", progress=False,
                        out_dir=tmp_path, token_budget=128, block_size=16)
    report = run_suite(opts)
    rows = _rows(report, "long-context")
    assert set(rows) == {"E", "G"}
    assert rows["E"]["useful_tokens"] == rows["G"]["useful_tokens"] == report["scenarios"][0]["useful_tokens"]
    assert rows["E"]["max_concurrency"] > rows["G"]["max_concurrency"]


def test_e2e_benchmark_reports_the_compiled_run():
    """``benchmarks/bench_e2e.py --compiled`` adds (e) and its ratios against HF to the table;
    the bench's engine settings turn compilation on for it."""
    import importlib.util
    from pathlib import Path

    from kvpage.tools.bench.runners.common import RunContext
    from kvpage.tools.bench.runners.paged import engine_config

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e.py"
    spec = importlib.util.spec_from_file_location("bench_e2e_under_test", path)
    bench_e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_e2e)
    row = lambda tps, wall: {"status": "ok", "useful_tokens_per_s": tps, "wall_s": wall, "num_steps": 3}  # noqa: E731
    rows = {"a_hf_static_b8": row(100.0, 4.0), "b_hf_continuous": row(200.0, 2.0), "c_kvpage": row(500.0, 0.8),
            "d_bare_forward": {**row(550.0, 0.7), "forward_in_run_s": 0.72}, "e_kvpage_compiled": row(650.0, 0.6)}
    ratios = bench_e2e._ratios(rows)
    assert ratios["compiled_vs_static"] == pytest.approx(6.5)
    assert ratios["compiled_vs_hf_continuous"] == pytest.approx(3.25)
    assert ratios["vs_hf_continuous"] == pytest.approx(2.5)
    table = bench_e2e.format_table({"model": "m", "num_params": 1e6, "num_requests": 2, "useful_tokens": 10,
                                    "prompt_tokens": 5, "systems": rows, "ratios": ratios})
    assert "| e_kvpage_compiled | 650.0 |" in table
    assert "| compiled_vs_hf_continuous | 3.25x (met) | >= 3.0x |" in table
    assert "| vs_hf_continuous | 2.50x (missed) | >= 3.0x |" in table
    del rows["e_kvpage_compiled"]
    assert "compiled_vs_static" not in bench_e2e._ratios(rows)
    from kvpage.tools.bench import model as model_mod
    from kvpage.tools.bench.workload import Scale, sharegpt

    loaded = model_mod.load("random-tiny", 0, "cpu")
    work = sharegpt(Scale(num_requests=2, prompt_median=8, prompt_sigma=0.1, output_median=4, output_sigma=0.1,
                          max_prompt=16, max_output=8, arrival_rate=0.0), loaded.vocab_size, 0)
    ctx = RunContext(workload=work, loaded=loaded, token_budget=16, unchunked_token_budget=16, seed=0,
                     kv_budget_bytes=1 << 20)
    assert engine_config(ctx, "D").enforce_eager is True
    assert engine_config(ctx, "D", enforce_eager=False).enforce_eager is False
