"""lm-eval-harness scores ``kvpage serve`` exactly as it scores the model itself.

lm-eval (the ``eval`` extra) runs a loglikelihood multiple-choice task and a greedy
``generate_until`` task (``tests/lm_eval_task/``, local JSON, no hub) three ways: its own
``hf`` model, and ``local-completions`` against a live ``kvpage serve`` with the HF
tokenizer and with the server's ``/tokenize`` (``tokenizer_backend=remote``). Loglikelihoods
must agree to 1e-4 and generations exactly.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server_process import running_server, save_tiny_model

pytest.importorskip("lm_eval", reason="needs the eval extra: pip install -e '.[eval]'")

TASK_DIR = Path(__file__).parent / "lm_eval_task"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


def _task_dir(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for template in TASK_DIR.glob("*.yaml.in"):
        (tasks / template.name.removesuffix(".in")).write_text(template.read_text().replace("DATA_DIR", str(TASK_DIR)))
    return tasks


def _run_lm_eval(tmp_path: Path, *model_pairs: str) -> list[dict]:
    out = tmp_path / "results.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, str(TASK_DIR / "run_eval.py"), str(_task_dir(tmp_path)), str(out),
                             *model_pairs], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


def test_lm_eval_local_completions_equals_hf(tmp_path, model_dir):
    with running_server(model_dir, "--dtype", "float32", "--block-size", "4", "--max-model-len", "256",
                        "--served-model-name", "tiny") as base:
        served = f"base_url={base}/v1/completions,model=tiny,tokenized_requests=True,max_length=256"
        hf, local, remote = _run_lm_eval(
            tmp_path, "hf", f"pretrained={model_dir},dtype=float32,device=cpu,max_length=256",
            "local-completions", f"{served},tokenizer={model_dir},tokenizer_backend=huggingface",
            "local-completions", f"{served},tokenizer_backend=remote")
    assert len(hf["kvpage_mc"]) == 10 and len(hf["kvpage_gen"]) == 8
    for other in (local, remote):
        for mine, theirs in zip(other["kvpage_mc"], hf["kvpage_mc"], strict=True):
            assert mine["doc_id"] == theirs["doc_id"]
            for (ll, greedy), (hf_ll, hf_greedy) in zip([r[0] for r in mine["resps"]], [r[0] for r in theirs["resps"]],
                                                         strict=True):
                assert ll == pytest.approx(hf_ll, abs=1e-4) and greedy == hf_greedy
        assert [d["resps"] for d in other["kvpage_gen"]] == [d["resps"] for d in hf["kvpage_gen"]]
    assert any(d["resps"][0][0] for d in hf["kvpage_gen"])  # the generations are not all empty
