"""``kvpage census`` on a fast subset, its supervisor's handling of hangs and crashes, the coverage
page, and ``kvpage check`` on a saved tiny model.

The census runs as its own process (``python -m kvpage census``): it forks one child per
family, which must happen before torch has run anything in the parent.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")

from kvpage.tools.census import runner  # noqa: E402
from kvpage.tools.census.report import exact_share, summary_line, to_markdown  # noqa: E402

SUBSET = "llama,deepseek_v3,mamba,bart,bloom,xlnet,inkling_text,cohere_compass_text"


def _kvpage(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpage", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=os.path.dirname(__file__))


@pytest.fixture(scope="module")
def census(tmp_path_factory):
    folder = tmp_path_factory.mktemp("census")
    out = _kvpage("census", "--families", SUBSET, "--json", str(folder / "c.json"), "--markdown",
                  str(folder / "coverage.md"))
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads((folder / "c.json").read_text()), (folder / "coverage.md").read_text(), out.stdout


def test_census_classifies_the_subset(census):
    data, _, stdout = census
    families = data["families"]
    assert families["llama"]["status"] == "exact"
    assert families["deepseek_v3"]["status"] == "exact"  # MLA: V's head smaller than K's
    for mode in ("stress", "plain"):
        assert families["llama"]["modes"][mode]["status"] == "exact"
    stress = families["llama"]["modes"]["stress"]
    assert stress["prefix_cache_hits"] > 0 and stress["preemptions"] > 0  # the stress mode did stress
    # Recurrent state in state slots: whole prompts (Mamba's prefill starts from zeros), preemption still runs.
    assert families["mamba"]["status"] == "exact" and families["mamba"]["modes"]["stress"]["preemptions"] > 0
    inkling = families["inkling_text"]  # a query-conditioned relative-position bias handed to attention
    assert inkling["status"] == "refused" and "mask or bias of its own making" in inkling["reason"]
    assert families["bart"]["status"] == "exact"  # positions relayed to its positional embedding
    assert families["bloom"]["status"] == "exact"  # an attention port, with ALiBi in kvpage's attention
    xlnet = families["xlnet"]
    assert xlnet["status"] == "refused" and "AttentionInterface" in xlnet["reason"]
    assert families["cohere_compass_text"]["status"] == "skipped"  # HF cannot build its default config
    assert "HF cannot build" in families["cohere_compass_text"]["reason"]
    assert data["summary"] == {"exact": 5, "refused": 2, "mismatch": 0, "skipped": 1}
    assert f"census: {summary_line(data)}" in stdout


def test_coverage_page_lists_every_family_with_its_reason(census, tmp_path):
    data, page, _ = census
    assert page == to_markdown(data)
    assert "**Summary: exact 5, refused 2, mismatch 0, skipped 1 (of 8 families).**" in page
    assert "| mamba | MambaForCausalLM |" in page and "| llama | LlamaForCausalLM |" in page
    assert "| a mask or bias of the model's own making | 1 |" in page  # inkling_text
    assert "| attention outside transformers' AttentionInterface | 1 |" in page  # xlnet
    assert exact_share(data) == 1.0
    source = tmp_path / "c.json"
    source.write_text(json.dumps(data))
    again = _kvpage("census", "--from-json", str(source), "--markdown", str(tmp_path / "again.md"))
    assert again.returncode == 0 and (tmp_path / "again.md").read_text() == page


def test_census_usage_errors():
    out = _kvpage("census", "--families", "llama,no_such_family")
    assert out.returncode == 2 and "no_such_family" in out.stderr
    out = _kvpage("census", "--from-json", "/nonexistent.json")
    assert out.returncode == 2 and "--markdown" in out.stderr


def _hang(name, report_phase):
    report_phase("kvpage")
    time.sleep(60)


def _die_in_hf(name, report_phase):
    report_phase("hf")
    os._exit(3)


def test_a_hang_or_crash_cannot_stop_the_census(monkeypatch):
    """Children are forked, so a patched ``run_family`` runs in them (no torch work here)."""
    from kvpage.tools.census import family

    monkeypatch.setattr(family, "run_family", _hang)
    hung = runner._run_in_child("llama", timeout_s=2)
    assert hung["status"] == "mismatch" and "did not finish in 2 s" in hung["reason"]
    monkeypatch.setattr(family, "run_family", _die_in_hf)
    died = runner._run_in_child("llama", timeout_s=30)
    assert died["status"] == "skipped" and "exit code 3" in died["reason"]


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    import torch

    from kvpage.tools.census.tiny_config import tiny_config
    from tiny_models import char_tokenizer, tiny_model

    llama = tmp_path_factory.mktemp("llama")
    tiny_model("llama").save_pretrained(llama)
    char_tokenizer().save_pretrained(llama)
    xlnet = tmp_path_factory.mktemp("xlnet")
    torch.manual_seed(0)
    import transformers as tf

    tf.XLNetLMHeadModel(tiny_config(tf.XLNetConfig)).save_pretrained(xlnet)
    return str(llama), str(xlnet)


def test_check_says_exact_for_a_served_model(saved_models, tmp_path):
    llama, _ = saved_models
    out = _kvpage("check", llama, "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1].startswith("verdict: exact") and len(lines) <= 12
    assert any(line.startswith("mode stress") and ": exact (" in line for line in lines)
    assert any(line.startswith("mode plain") and ": exact (" in line for line in lines)
    assert any(line.startswith("KV per token: 2 x (K [2x16] + V [2x16])") for line in lines)
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "exact"


def test_check_names_the_reason_for_a_refused_model(saved_models):
    _, xlnet = saved_models
    out = _kvpage("check", xlnet)
    assert out.returncode == 1
    assert "verdict: refused" in out.stdout and "AttentionInterface" in out.stdout


def test_check_of_a_folder_that_is_no_model_is_one_line(tmp_path):
    out = _kvpage("check", str(tmp_path))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().count("\n") == 0 and "(with config.json)" in out.stderr
