"""``EngineConfig.batch_invariant``: a request's output bits do not depend on the schedule.

The exact mode gives HF's float32 arithmetic op for op, but torch's matmuls pick their
kernel by the row count of the call, so a request's logits follow what else shares its
steps (and a quantized KV code can then move by a whole step). Batch-invariant mode runs
linears on tiles of a fixed row count (``adapters/row_tiled_linear.py``) and every
attention row through the prompt kernel. Here a request alone, with nothing beside it and
its prompt whole, must get the very bits (tokens and log-probabilities) it gets in a
crowded engine: chunked prompts, neighbours, prefix hits and preemption, for the model's
own KV cache and for the quantized formats, in float32 and in bf16.
"""
from __future__ import annotations

import pytest
import torch

from kvpage import EngineConfig, SamplingParams
from kvpage.adapters.row_tiled_linear import TILE_ROWS, RowTiledLinear
from test_kv_cache_dtype_engine import engine  # LLM over its BASE settings, integrity checked, closed
from tiny_models import VOCAB, tiny_model

FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True, logprobs=2)


def _prompts() -> list[list[int]]:
    """Six prompts, every other one behind a shared 12-token prefix (three blocks)."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, VOCAB, (12,), generator=g).tolist()
    return [(shared if i % 2 else []) + torch.randint(3, VOCAB, (n,), generator=g).tolist()
            for i, n in enumerate((23, 30, 17, 26, 35, 21))]


def _bits(outs) -> list:
    return [[(list(s.token_ids), s.logprobs) for s in out.outputs] for out in outs]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _alone_and_in_a_crowd(model, name: str, crowd_blocks: int = 24, **options) -> dict:
    """Each prompt alone (one request, its prompt whole), then all together in a crowded
    engine (7-token steps, a small pool, prefix caching); asserts equal bits, greedy and
    seeded; returns the crowded engine's stats."""
    prompts = _prompts()
    with engine(model, name, batch_invariant=True, num_kv_blocks=128, max_num_batched_tokens=128,
                enable_prefix_caching=False, **options) as llm:
        alone = {label: [_bits(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
                 for label, params in (("greedy", GREEDY), ("seeded", SEEDED))}
    with engine(model, name, batch_invariant=True, num_kv_blocks=crowd_blocks, max_num_batched_tokens=7,
                **options) as llm:
        for label, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            crowd = _bits(llm.generate(prompts, params, use_tqdm=False))
            assert crowd == alone[label], label
        return llm.stats()


@pytest.mark.parametrize("name, dtype", [(name, "float32") for name in FORMATS] + [("auto", "bfloat16"),
                                                                                   ("int8", "bfloat16")])
def test_a_request_alone_and_in_a_crowd_gets_the_same_bits(llama, name, dtype):
    stats = _alone_and_in_a_crowd(llama, name, dtype=dtype)
    assert stats["num_preemptions"] > 0, "the pool should be too small for the batch"
    assert stats["prefix_cache_hits"] > 0, "the second round should hit the prefix cache"


@pytest.mark.parametrize("family, name, blocks", [("gemma2", "auto", 30), ("gemma3", "int8", 35),
                                                  ("mistral", "fp8_e4m3", 24), ("qwen3", "int4", 24),
                                                  ("gpt2", "auto", 24)])
def test_sliding_windows_softcaps_and_other_heads_too(family, name, blocks):
    """Sliding windows (hybrid groups), logit softcaps, head sizes of 16 and GPT-2's Conv1D
    projections; ``blocks``: a pool just large enough for one request of ``max_model_len``."""
    stats = _alone_and_in_a_crowd(tiny_model(family), name, crowd_blocks=blocks)
    assert stats["num_preemptions"] > 0, "the pool should be too small for the batch"


def test_row_tiled_linear_rows_depend_on_themselves_alone():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200)
    tiled = RowTiledLinear(linear)
    x = torch.randn(3 * TILE_ROWS + 5, 96)
    whole = tiled(x)
    torch.testing.assert_close(whole, linear(x))
    for rows in (1, 2, 7, TILE_ROWS, TILE_ROWS + 1):
        for start in (0, 3, 40):
            assert torch.equal(tiled(x[start:start + rows]), whole[start:start + rows]), (rows, start)
    assert torch.equal(tiled(x.view(1, -1, 96))[0], whole)  # any leading shape


def test_conv1d_projections_are_tiled_alike():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(200, 96)
    tiled = RowTiledLinear(conv)
    x = torch.randn(2 * TILE_ROWS + 3, 96)
    whole = tiled(x)
    torch.testing.assert_close(whole, conv(x))
    assert torch.equal(tiled(x[5:6]), whole[5:6])


def test_a_model_with_recurrent_state_is_refused():
    with pytest.raises(ValueError, match="batch_invariant covers attention models"):
        engine(tiny_model("mamba"), "auto", batch_invariant=True).__enter__()


def test_settings_it_contradicts_are_value_errors():
    for clash in (dict(enforce_eager=False), dict(onednn_linears=True), dict(linear_compute_dtype="float32")):
        with pytest.raises(ValueError, match="batch_invariant=True runs the model eagerly"):
            EngineConfig(batch_invariant=True, **clash)
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        EngineConfig(batch_invariant="yes")
    assert EngineConfig(batch_invariant=True).exact_mode


def test_a_backend_without_the_mode_is_refused():
    from kvpage.adapters.attention_backends import select_backend

    with pytest.raises(ValueError, match="no batch-invariant mode"):
        select_backend("reference", torch.device("cpu"), batch_invariant=True)
