"""Hybrid KV memory end to end: sliding-window families stay exact against HF ``generate``
with prompts several windows long, under chunked prefill, prefix hits and preemption, while
their sliding groups give blocks back."""
from __future__ import annotations

import pytest
import torch

from kvpage import LLM, SamplingParams
from tiny_models import VOCAB, hf_greedy, tiny_model

MAX_NEW = 12
WINDOW = 8  # every sliding family of the matrix uses an 8-token window
HYBRID_FAMILIES = ["gemma2", "gemma3", "gpt_oss"]  # full and sliding layers mixed
ALL_SLIDING = ["mistral", "starcoder2"]  # one kind only: a single group that keeps everything


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=HYBRID_FAMILIES + ALL_SLIDING)
def family_model(request):
    return request.param, tiny_model(request.param)


def _generate(model, prompts, max_num_seqs=8, max_model_len=128, **options):
    llm = LLM(model, max_model_len=max_model_len, max_num_seqs=max_num_seqs, **options)
    try:
        kv = llm.engine.scheduler.kv
        peak_sliding = [0]

        def observe(*_):
            for request in llm.engine.scheduler.running:
                for g in kv.sliding_groups:
                    peak_sliding[0] = max(peak_sliding[0], len(request.held_blocks(g)))

        params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(prompt, params, request_id=str(i))
        finished = {}
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            observe()
            llm.check_integrity()
            finished.update({rid: out.outputs[0].token_ids for rid, out in llm.engine.take_finished().items()})
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"], "blocks leaked"
        return [finished[str(i)] for i in range(len(prompts))], stats, kv.num_groups, peak_sliding[0]
    finally:
        llm.restore()


SCENARIOS = {
    # Prompts of 3-7 windows in chunks of 7 tokens: blocks leave the window during prefill.
    "chunked": dict(block_size=4, num_kv_blocks=160, max_num_batched_tokens=7),
    "whole-prompt": dict(block_size=4, num_kv_blocks=160, enable_chunked_prefill=False),
    # Too few blocks for all at once: preemption and recompute.
    "preemption": dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, max_model_len=72),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_long_prompts_match_hf(family_model, scenario):
    family, model = family_model
    prompts = _prompts(7, (25, 40, 33, 56, 19))
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    got, stats, num_groups, peak = _generate(model, prompts, **SCENARIOS[scenario])
    assert got == expected, f"{family} / {scenario}"
    if family in HYBRID_FAMILIES:
        assert num_groups > 1
        chunk = SCENARIOS[scenario].get("max_num_batched_tokens", 1)
        # Between steps a sliding group keeps its window only (the last step may still
        # hold one prefill chunk's blocks, which `observe` sees after the step).
        assert peak <= -(-(WINDOW - 1 + min(chunk, 56)) // 4) + 1
    else:
        assert num_groups == 1
    if scenario == "preemption" and family in HYBRID_FAMILIES:
        assert stats["num_preemptions"] > 0


def test_prefix_hits_past_the_window_are_exact(family_model):
    family, model = family_model
    shared = _prompts(8, (36,))[0]  # nine blocks of 4, four and a half windows
    tails = _prompts(9, (0, 1, 5, 9))
    prompts = [shared + t for t in tails] + [shared[:21] + tails[2]]
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    got, stats, _, _ = _generate(model, [prompts[0]] + prompts, max_num_seqs=1, block_size=4, num_kv_blocks=160)
    assert got[1:] == expected, family
    assert stats["prefix_cache_hits"] >= 4 * 32  # every later prompt reuses most of the shared head


def test_hybrid_off_matches_hybrid_on():
    model = tiny_model("gemma3")
    prompts = _prompts(10, (30, 45))
    on, _, groups_on, _ = _generate(model, prompts, block_size=4, num_kv_blocks=120, max_num_batched_tokens=9)
    off, _, groups_off, _ = _generate(model, prompts, block_size=4, num_kv_blocks=120, max_num_batched_tokens=9,
                                      disable_hybrid_kv_cache_manager=True)
    assert on == off and groups_on == 3 and groups_off == 1


def test_group_metrics_are_reported():
    from prometheus_client import generate_latest

    from kvpage.entrypoints.openai.metrics import ServerMetrics

    llm = LLM(tiny_model("gemma2"), block_size=4, num_kv_blocks=64, max_model_len=128)
    try:
        groups = llm.stats()["kv_groups"]
        assert [g["sliding_window"] for g in groups] == [None, WINDOW]
        assert all(g["usage"] == 0.0 and g["fragmentation"] == 0.0 for g in groups)
        llm.engine.add_request(_prompts(11, (30,))[0], SamplingParams(max_tokens=30, ignore_eos=True))
        for _ in range(3):
            llm.engine.step()
        lines = generate_latest(ServerMetrics(llm.stats).registry).decode().splitlines()
        full = [line for line in lines if line.startswith('kvpage:kv_group_usage_perc{group="0",window="full"}')]
        sliding = [line for line in lines
                   if line.startswith(f'kvpage:kv_group_usage_perc{{group="1",window="{WINDOW}"}}')]
        assert full and sliding
        # The full group holds the whole context, the sliding one its window only.
        assert float(full[0].split()[-1]) > float(sliding[0].split()[-1]) > 0
        llm.engine.abort_all()
    finally:
        llm.restore()


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt_oss", "mistral", "llama", "deepseek_v3"])
def test_config_spec_matches_the_probe(family):
    """``kvpage plan`` reads the spec from the config; the engine probes the model: they agree."""
    from kvpage.adapters.config_spec import kv_spec_from_config

    model = tiny_model(family)
    llm = LLM(model, block_size=4, num_kv_blocks=64, max_model_len=64)
    try:
        probed = llm.runner.kv_cache.spec
        planned = kv_spec_from_config(model.config, 4, probed.dtype)
        assert planned.layers == probed.layers
        assert planned.kv_groups().windows == probed.kv_groups().windows
    finally:
        llm.restore()
