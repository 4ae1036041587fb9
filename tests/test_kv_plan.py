"""``kvpage plan``: the KV memory plan from a config, hybrid on and off, and its refusals."""
from __future__ import annotations

import json

import pytest

from kvpage.entrypoints.cli.main import main

GIB = 1 << 30


@pytest.fixture(scope="module")
def gemma3_pattern(tmp_path_factory):
    """A Gemma3-pattern config: five sliding layers (window 1024, 1/8 of 8k) to one full."""
    import transformers as tf

    folder = tmp_path_factory.mktemp("gemma3-pattern")
    tf.Gemma3TextConfig(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=12,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=1024,
                        max_position_embeddings=8192,
                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2).save_pretrained(folder)
    return folder


def _plan(capsys, *argv) -> dict:
    assert main(["plan", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_hybrid_quadruples_concurrency_at_8k(gemma3_pattern, capsys):
    plan = _plan(capsys, gemma3_pattern, "--max-model-len", 8192, "--kv-cache-memory", "4GiB")
    hybrid, single = plan["with_hybrid"], plan["without_hybrid"]
    assert hybrid["hybrid"] and not single["hybrid"]
    assert plan["concurrency_ratio"] >= 3.0
    # The arithmetic: 512 blocks for the full group, 65 for each of the five sliding ones.
    assert [g["blocks_per_request"] for g in hybrid["groups"]] == [512] + [65] * 5
    assert hybrid["blocks_per_request"] == 512 + 5 * 65 and single["blocks_per_request"] == 512
    assert hybrid["kv_cache_bytes"] <= 4 * GIB and single["kv_cache_bytes"] <= 4 * GIB
    per_layer_token = 2 * 2 * 64 * 2  # K and V, 2 heads of 64, bf16
    assert hybrid["groups"][0]["kv_bytes_per_token"] == 2 * per_layer_token  # two layers per group
    assert single["groups"][0]["kv_bytes_per_token"] == 12 * per_layer_token
    assert single["max_concurrency"] == 4 * GIB // (16 * 12 * per_layer_token) // 512


def test_plan_numbers_are_the_engines(gemma3_pattern, capsys):
    """The engine built from the same config gets the block count the plan printed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvpage import LLM

    plan = _plan(capsys, gemma3_pattern, "--max-model-len", 2048, "--kv-cache-memory", "64MiB", "--dtype", "float32",
                 "--max-num-batched-tokens", 256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(gemma3_pattern)).eval()
    for layout, disable in (("with_hybrid", False), ("without_hybrid", True)):
        llm = LLM(model, max_model_len=2048, kv_cache_memory=64 << 20, max_num_batched_tokens=256, dtype="float32",
                  disable_hybrid_kv_cache_manager=disable)
        try:
            assert llm.stats()["num_blocks"] == plan[layout]["num_blocks"], layout
        finally:
            llm.restore()


def test_text_output_and_a_budget_too_small(gemma3_pattern, capsys):
    assert main(["plan", str(gemma3_pattern), "--max-model-len", "8192", "--kv-cache-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "hybrid KV groups" in out and "max concurrency" in out and "x the concurrent requests" in out
    assert main(["plan", str(gemma3_pattern), "--max-model-len", "8192", "--kv-cache-memory", "1MiB"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvpage plan: ") and "cannot hold one request" in err and "needs" in err


def test_plans_the_engine_would_refuse_are_errors(gemma3_pattern, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(gemma3_pattern), "--max-model-len", "1024", "--block-size", "7"])
    assert exc.value.code == 2 and "a block size is a power of two" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(gemma3_pattern), "--max-model-len", "1024", "--gpu-memory-utilization", "5"])
    assert exc.value.code == 2 and "a share of memory is in (0, 1]" in capsys.readouterr().err
    assert main(["plan", str(gemma3_pattern), "--max-model-len", "10000000", "--kv-cache-memory", "1GiB"]) == 1
    assert "exceeds the model's" in capsys.readouterr().err


def test_a_model_without_sliding_layers_is_not_hybrid(tmp_path, capsys):
    import transformers as tf

    tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2).save_pretrained(tmp_path)
    plan = _plan(capsys, tmp_path, "--max-model-len", 1024, "--kv-cache-memory", "64MiB")
    assert not plan["with_hybrid"]["hybrid"] and plan["concurrency_ratio"] == 1.0
    assert "same attention kind" in plan["with_hybrid"]["reason"]
