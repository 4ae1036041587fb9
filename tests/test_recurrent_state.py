"""Models with recurrent layers (state-space mixers, gated delta nets) run exactly on state slots.

Six tiny families: Mamba (recurrent layers only, no KV at all; its prefill starts from a
zero state, so the engine turns chunked prefill off), Jamba (Mamba layers beside an
attention layer), Qwen3-Next (a gated delta net beside full attention; its prefill
resumes from a stored state, so chunks stay on), MiniMax (lightning attention, its state
in MiniMax's own cache class), RWKV (no attention; its state in the list its forward
takes and returns) and RecurrentGemma (RG-LRU blocks beside local attention, their state
kept on the blocks themselves). Greedy output equals HF ``generate``
token for token under batching, chunking, preemption and parallel-sample forks.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage import LLM, SamplingParams
from kvpage.core.kv.block_pool import BlockPool
from kvpage.core.kv.kv_cache_manager import KVCacheManager
from kvpage.core.sched.metadata import build_step_metadata
from kvpage.core.kv.radix_cache import RadixCache
from kvpage.core.request import Request
from kvpage.core.kv.state_slots import StateSlotPool
from tiny_models import RECURRENT_FAMILIES, VOCAB, hf_greedy, tiny_model

MAX_NEW = 8


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=RECURRENT_FAMILIES)
def family_model(request):
    return request.param, tiny_model(request.param)


def _generate(model, prompts, params=None, max_model_len=64, **options):
    llm = LLM(model, max_model_len=max_model_len, **options)
    try:
        outs = llm.generate(prompts, params or SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"], "blocks leaked"
        scheduler = llm.engine.scheduler
        scheduler.check_integrity()
        assert scheduler.state_slots.num_used == 0, "state slots leaked"
        assert not any(o.outputs[0].error for o in outs), [o.outputs[0].error for o in outs]
        return outs, stats, llm.engine
    finally:
        llm.restore()


CONFIGS = {
    "chunked-small-budget": dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=7),
    "unchunked": dict(block_size=8, num_kv_blocks=64, enable_chunked_prefill=False),
    # 9 blocks of 4 tokens cannot hold six sequences of up to 28 tokens: preemption must happen.
    "preempting-pool": dict(block_size=4, num_kv_blocks=9, max_num_batched_tokens=16, max_model_len=32),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_hf(family_model, config_name):
    family, model = family_model
    prompts = _prompts(1, (1, 3, 5, 11, 20, 6))
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    outs, stats, _ = _generate(model, prompts, **CONFIGS[config_name])
    assert [o.outputs[0].token_ids for o in outs] == expected, f"{family} / {config_name}"
    if config_name == "preempting-pool":
        assert stats["num_preemptions"] > 0  # recomputation restarted from a zero state


def test_forked_samples_copy_the_parents_state(family_model):
    """``n=3`` greedy samples fork after the prompt: each child's state is its parent's copy."""
    family, model = family_model
    prompts = _prompts(2, (7, 4))
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    params = SamplingParams(n=3, max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outs, _, _ = _generate(model, prompts, params, block_size=4, num_kv_blocks=64)
    for out, want in zip(outs, expected):
        assert [sample.token_ids for sample in out.outputs] == [want] * 3, family


def test_engine_settings_follow_the_model(family_model, caplog):
    """Prefix caching is off for every recurrent model; chunked prefill only where the
    model's prefill resumes from a stored state (all but Mamba and Jamba, whose Mamba
    prefill starts from zeros), and the step-time target (``kvpage serve``'s default) with
    it; a model with no attention layers holds no KV memory."""
    family, model = family_model
    with caplog.at_level(logging.INFO, logger="kvpage"):
        _, stats, engine = _generate(model, _prompts(3, (9, 9)), block_size=4, num_kv_blocks=32, max_step_ms="auto")
    scheduler = engine.scheduler
    assert scheduler.prefix_cache is None and stats["prefix_cache_hits"] == 0
    chunked = family in ("qwen3_next", "minimax", "rwkv")
    assert scheduler.config.enable_chunked_prefill == chunked
    assert scheduler.config.max_step_ms == ("auto" if chunked else None) and (scheduler.step_budget is None) != chunked
    assert "prefix caching off" in caplog.text
    assert scheduler.state_slots.num_slots == scheduler.config.max_num_seqs
    runner = engine.runner
    assert runner.state_slots.nbytes > 0
    if family in ("mamba", "rwkv"):
        assert runner.layer_specs == [] and runner.kv_cache.nbytes == 0


def test_kv_tiers_are_refused_for_recurrent_models():
    model = tiny_model("mamba")
    with pytest.raises(ValueError, match="recurrent layers cannot use"):
        LLM(model, max_model_len=64, block_size=4, num_kv_blocks=32, kv_offloading_size=0.001)
    assert model.config._attn_implementation != "kvpage"


# ---------------------------------------------------------------------- core: the slot pool


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(st.integers(1, 6), st.lists(st.booleans(), max_size=40))
def test_slot_pool_accounting(num_slots, allocate_ops):
    pool = StateSlotPool(num_slots)
    held: list[int] = []
    for allocate in allocate_ops:
        if allocate:
            slot = pool.allocate()
            if len(held) == num_slots:
                assert slot is None
            else:
                assert slot is not None and slot not in held
                held.append(slot)
        elif held:
            pool.free(held.pop(0))
        assert pool.num_free + pool.num_used == num_slots and pool.num_used == len(held)
        pool.check_integrity()
    with pytest.raises(ValueError, match="not held"):
        pool.free(num_slots)


def test_slot_pool_rejects_bad_sizes():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="num_state_slots"):
            StateSlotPool(bad)


def test_state_slots_need_the_prefix_cache_off():
    pool = BlockPool(8, 4)
    with pytest.raises(ValueError, match="enable_prefix_caching off"):
        KVCacheManager(pool, RadixCache(pool), state_slots=StateSlotPool(2))


def test_a_request_without_a_free_slot_waits():
    kv = KVCacheManager(BlockPool(16, 4), state_slots=StateSlotPool(1))
    first, second = Request("a", [1, 2, 3]), Request("b", [4, 5])
    assert kv.allocate_slots(first, 3) and first.state_slot == 0
    free_blocks = kv.pool.num_free_blocks
    assert not kv.allocate_slots(second, 2)  # no slot: nothing taken
    assert second.state_slot is None and not second.block_ids and kv.pool.num_free_blocks == free_blocks
    kv.free(first)
    assert first.state_slot is None and kv.allocate_slots(second, 2) and second.state_slot == 0


def test_step_metadata_carries_slots_and_selects_parts():
    kv = KVCacheManager(BlockPool(32, 4), state_slots=StateSlotPool(5))
    requests = [Request(f"r{i}", list(range(3, 3 + n))) for i, n in enumerate((1, 6, 2, 6))]
    for r in requests:
        assert kv.allocate_slots(r, r.num_tokens)
    child = Request("child", [3])
    kv.fork(requests[0], child)
    meta = build_step_metadata(requests, [r.num_tokens for r in requests], 4, state_copies=kv.take_state_copies())
    assert meta.state_slots.tolist() == [r.state_slot for r in requests]
    assert meta.state_copies.tolist() == [[requests[0].state_slot, child.state_slot]]
    assert kv.take_state_copies() == []  # handed out once
    part, rows = meta.select(np.array([1, 3]))
    assert rows.tolist() == list(range(1, 7)) + list(range(9, 15))  # query lengths 1, 6, 2, 6
    assert part.input_ids.tolist() == meta.input_ids[rows].tolist()
    assert part.query_start_loc.tolist() == [0, 6, 12] and part.num_decodes == 0
    assert part.state_slots.tolist() == [requests[1].state_slot, requests[3].state_slot]
    assert part.block_tables.tolist() == meta.block_tables[[1, 3]].tolist()
    assert part.slot_mapping.tolist() == meta.slot_mapping[rows].tolist() and len(part.state_copies) == 0


# ---------------------------------------------------------------------- served live


def test_server_streams_a_hybrid_model_exactly(tmp_path):
    """``kvpage serve`` on a saved Jamba (Mamba layers beside attention): concurrent streamed
    completions equal HF's greedy continuations, token for token."""
    import asyncio
    import json

    import httpx

    from server_process import running_server
    from tiny_models import char_tokenizer

    model, tokenizer = tiny_model("jamba"), char_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = ["hello there", "state slots", "a", "recurrent layers keep state"]
    expected = [tokenizer.decode(hf_greedy(model, tokenizer(p)["input_ids"], MAX_NEW), skip_special_tokens=True)
                for p in prompts]

    async def complete(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": str(tmp_path), "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text = ""
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def run_all(base: str) -> list:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            return await asyncio.gather(*(complete(client, p) for p in prompts))

    with running_server(str(tmp_path), "--block-size", "4", "--num-kv-blocks", "64", "--max-model-len", "64") as base:
        assert asyncio.run(run_all(base)) == expected
        metrics = httpx.get(base + "/metrics", timeout=10).text
        assert "kvpage" in metrics or "vllm" in metrics


@pytest.mark.parametrize("family, layers", [("bamba", {"attn_layer_indices": [1]}),
                                            ("granitemoehybrid", {"layer_types": ["mamba", "attention"]})])
def test_hybrids_the_census_skips_are_exact_with_an_attention_layer(family, layers):
    """Bamba's and GraniteMoeHybrid's default configs have Mamba layers only, on which HF's
    own ``generate`` fails (the census skips them); with one attention layer both run
    exactly in the census's two modes."""
    import transformers as tf

    from kvpage.tools.census.compare import census_prompts, compare_with_hf
    from kvpage.tools.census.tiny_config import tiny_overrides

    config_class, model_class = {"bamba": (tf.BambaConfig, tf.BambaForCausalLM),
                                 "granitemoehybrid": (tf.GraniteMoeHybridConfig, tf.GraniteMoeHybridForCausalLM)}[family]
    torch.manual_seed(0)
    model = model_class._from_config(config_class(**{**tiny_overrides(config_class), **layers}),
                                     dtype=torch.float32).eval()
    results = compare_with_hf(model, census_prompts(model.get_input_embeddings().weight.shape[0]), 8, 48)
    assert {mode: r.status for mode, r in results.items()} == {"stress": "exact", "plain": "exact"}


def test_check_reports_the_state_beside_the_kv():
    """``kvpage check``'s layout line names the recurrent state, per sequence, beside any KV."""
    from kvpage.tools.census.check import _kv_layout

    assert _kv_layout(tiny_model("mamba")).startswith("none (no attention layers); recurrent state in 2 layers, ")
    jamba = _kv_layout(tiny_model("jamba"))
    assert jamba.startswith("1 x (K [2x16] + V [2x16]) = 256 bytes in float32; recurrent state in 2 layers, ")
