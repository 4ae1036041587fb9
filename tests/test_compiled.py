"""The compiled runner (``enforce_eager=False``): greedy output still equals HF token for token.

Each family compiles once (inductor, dynamic shapes) and then runs chunked prefill with a
tiny budget, prefix-cache hits and preemption in one engine. CI runs a subset that covers
the attention variants (GQA, sliding window, softcap + final logit softcap, q/k norm, a
model without ``logits_to_keep``); ``KVPAGE_COMPILED_MATRIX=1`` runs every family.
"""
from __future__ import annotations

import os

import pytest
import torch

from kvpage import LLM, SamplingParams
from tiny_models import EXTENDED_FAMILIES, FAMILIES, VOCAB, hf_greedy, kv_groups_of, tiny_model

SUBSET = ["llama", "mistral", "gemma2", "qwen3", "gpt2", "bart"]
MATRIX = FAMILIES + EXTENDED_FAMILIES if os.environ.get("KVPAGE_COMPILED_MATRIX") else SUBSET


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.slow
@pytest.mark.parametrize("family", MATRIX)
def test_compiled_greedy_matches_hf(family):
    _check_compiled_greedy(family)


@pytest.mark.slow
def test_compiled_with_cpp_wrapper_matches_hf(monkeypatch):
    """The default outside the test suite (conftest turns it off for speed): the graph's
    wrapper in C++, calling the kvpage custom ops through the dispatcher."""
    monkeypatch.setenv("KVPAGE_CPP_WRAPPER", "1")
    _check_compiled_greedy("llama")


def _check_compiled_greedy(family: str) -> None:
    model = tiny_model(family)
    shared = _prompts(7, (12,))[0]
    prompts = _prompts(8, (1, 5, 17)) + [shared + t for t in _prompts(9, (0, 3, 6))]
    expected = [hf_greedy(model, p, 10) for p in prompts]
    # 14 blocks of 4 tokens (56 slots) cannot hold all six sequences: preemption happens too.
    llm = LLM(model, block_size=4, num_kv_blocks=14 * kv_groups_of(model), max_num_batched_tokens=7, max_model_len=48,
              enforce_eager=False)
    try:
        assert llm.runner.compiled is not None
        outs = llm.generate([prompts[3]] + prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[1:]] == expected, family
        stats = llm.stats()
        assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0
        assert stats["num_free_blocks"] == stats["num_blocks"]
        llm.check_integrity()
    finally:
        llm.restore()


@pytest.mark.slow
def test_thread_count_change_after_warm_up_recompiles_instead_of_failing():
    """Dynamo guards the graph on torch's thread count. A compiled engine runs no thread
    governor, but an embedder may still change the count: the step that meets the new count
    recompiles (with guards checked from then on) and no request fails."""
    llm = LLM(tiny_model("llama"), block_size=4, num_kv_blocks=64, max_model_len=48, enforce_eager=False)
    threads = torch.get_num_threads()
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = _prompts(4, (3, 9))
    try:
        assert llm.engine.thread_governor is None
        torch.set_num_threads(threads)
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        torch.set_num_threads(1 if threads > 1 else 2)
        after = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].finish_reason for o in after] == ["length", "length"]
        assert [o.outputs[0].token_ids for o in after] == before
        assert not llm.runner.compiled.skip_guards
    finally:
        torch.set_num_threads(threads)
        llm.restore()


@pytest.mark.slow
def test_governed_compiled_engine_has_an_entry_for_one_thread_fewer(monkeypatch):
    """With a thread governor, the warm-up also compiles the graph at one thread fewer, so
    the governor's switch under a busy neighbour never compiles mid-run."""
    from torch._dynamo.utils import counters

    from kvpage.platform.threads import configure_threads

    threads = configure_threads(None)
    if threads < 2:
        pytest.skip("one CPU: nothing for a governor to lower")
    monkeypatch.setenv("KVPAGE_THREAD_GOVERNOR", "1")
    monkeypatch.delenv("KVPAGE_NUM_THREADS", raising=False)
    # Beside a busy process the governor's first look may already have lowered torch's
    # count, so the configured count, not torch's, names the two entries.
    llm = LLM(tiny_model("llama"), block_size=4, num_kv_blocks=64, max_model_len=48, max_num_seqs=4,
              enforce_eager=False)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = _prompts(5, (3, 9))
    try:
        governor = llm.engine.thread_governor
        assert governor is not None and governor.counts == (threads - 1, threads)
        torch.set_num_threads(threads)
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        frames = counters["frames"]["ok"]
        torch.set_num_threads(threads - 1)  # what the governor's apply does
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert after == before
        assert counters["frames"]["ok"] == frames  # no compile: the entry was there
        assert llm.runner.compiled.skip_guards
    finally:
        torch.set_num_threads(threads)
        llm.restore()


def test_enforce_eager_runs_op_by_op():
    llm = LLM(tiny_model("llama"), block_size=4, num_kv_blocks=16, max_model_len=64, enforce_eager=True)
    assert llm.runner.compiled is None
    llm.restore()


def test_row_counts_are_padded_to_buckets():
    from kvpage.adapters.compiled_forward import padded_rows

    sizes = (1, 2, 3, 8, 9, 34, 512, 513, 1509, 2048)
    assert [padded_rows(n) for n in sizes] == [2, 2, 8, 8, 16, 40, 512, 576, 1536, 2048]


@pytest.mark.slow
def test_steps_after_warm_up_never_compile():
    """The warm-up compiles the one entry every step uses (its inputs are made under inference
    mode, as the steps' are), so the guards the steps skip would only have confirmed it."""
    from torch._dynamo.utils import counters

    llm = LLM(tiny_model("llama"), block_size=4, num_kv_blocks=64, max_num_batched_tokens=9, max_model_len=48,
              max_num_seqs=12, enforce_eager=False)
    try:
        compiled_frames = counters["frames"]["ok"]
        outs = llm.generate(_prompts(3, (1, 4, 13, 2, 30)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
        assert counters["frames"]["ok"] == compiled_frames
    finally:
        llm.restore()
