"""Greedy output of kvpage equals HF ``generate`` token for token, for every family.

One unpadded prompt at a time through HF (fp32) is the oracle. kvpage runs all prompts
together, under chunked prefill on and off, tiny chunk budgets, prefix-cache hits
(including hits ending exactly on a block boundary), and a pool so small that requests
are preempted and recomputed.
"""
from __future__ import annotations

import pytest
import torch

from kvpage import LLM, SamplingParams
from kvpage.adapters.hf_runner import UnsupportedModelError
from tiny_models import EXTENDED_FAMILIES, FAMILIES, UNSUPPORTED_FAMILIES, VOCAB, hf_greedy, kv_groups_of, tiny_model

MAX_NEW = 10


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _run(model, prompts, **options) -> list[list[int]]:
    llm = LLM(model, **options)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"], "blocks leaked"
        llm.check_integrity()
        return [o.outputs[0].token_ids for o in outs], stats
    finally:
        llm.restore()


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    model = tiny_model(request.param)
    return request.param, model


CONFIGS = {
    "chunked-small-budget": dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=7, enable_chunked_prefill=True),
    "unchunked": dict(block_size=8, num_kv_blocks=64, enable_chunked_prefill=False),
    "no-prefix-cache": dict(block_size=16, num_kv_blocks=32, enable_prefix_caching=False),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_hf(family_model, config_name):
    family, model = family_model
    prompts = _prompts(1, (1, 3, 4, 5, 11, 20))
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    got, _ = _run(model, prompts, max_model_len=128, **CONFIGS[config_name])
    assert got == expected, f"{family} / {config_name}"


def test_prefix_cache_hits_are_exact(family_model):
    family, model = family_model
    shared = _prompts(2, (16,))[0]  # exactly four blocks of 4: hits end on a block boundary
    tails = _prompts(3, (0, 1, 3, 4, 6))
    prompts = [shared + t for t in tails] + [shared[:9] + tails[2], shared[:8]]
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    # Run the shared prompt first so the others find it cached.
    llm_prompts = [prompts[0]] + prompts
    got, stats = _run(model, llm_prompts, block_size=4, num_kv_blocks=96, max_num_seqs=1, max_model_len=128)
    assert got[1:] == expected, family
    assert stats["prefix_cache_hits"] > 0


def test_preemption_recompute_is_exact(family_model):
    family, model = family_model
    prompts = _prompts(4, (9, 14, 6, 12, 10, 7))
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    # 12 blocks of 4 tokens cannot hold six sequences of up to 24 tokens: preemption must happen.
    # (A hybrid model's block holds one KV group's layers: the same bytes are more blocks.)
    got, stats = _run(model, prompts, block_size=4, num_kv_blocks=12 * kv_groups_of(model), max_num_batched_tokens=16,
                      max_model_len=48)
    assert got == expected, family
    assert stats["num_preemptions"] > 0


def _hf_generate(model, prompt, max_new, eos, min_new=0) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=min_new,
                             do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_min_tokens_masks_eos_and_stop_ids_like_hf(family_model):
    """``min_tokens=n`` with ``ignore_eos`` equals HF ``generate(min_new_tokens=n, max_new_tokens=n)``.

    The model's EOS is set to the token greedy decoding emits first, and the stop id to the
    token it emits first once EOS is masked, so without the mask both would end the output
    at once (asserted through HF itself): the test proves the mask, not a lucky run.
    """
    family, model = family_model
    n = 6
    prompts = _prompts(10, (3, 8, 13))
    eos = hf_greedy(model, prompts[0], 1)[0]
    assert _hf_generate(model, prompts[0], n, eos=eos)[0] == eos  # HF alone would stop on EOS right away
    stop = _hf_generate(model, prompts[0], 1, eos=eos, min_new=1)[0]  # the winner once EOS is masked
    assert stop != eos
    expected = [_hf_generate(model, p, n, eos=[eos, stop], min_new=n) for p in prompts]
    assert all(eos not in e and stop not in e for e in expected)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    llm = LLM(model, block_size=4, num_kv_blocks=64, max_num_batched_tokens=7, max_model_len=128)
    try:
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True, stop_token_ids=[stop])
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.restore()
        model.generation_config.eos_token_id = saved
    assert got == expected, family


@pytest.mark.parametrize("family", EXTENDED_FAMILIES)
def test_extended_families_match_hf(family):
    model = tiny_model(family)
    prompts = _prompts(5, (2, 9, 17))
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    got, _ = _run(model, prompts, max_model_len=128, block_size=4, num_kv_blocks=48, max_num_batched_tokens=6)
    assert got == expected, family


@pytest.mark.parametrize("family, k_dim, v_dim, reuses", [
    ("deepseek_v3", 24, 8, [None, None]),  # MLA: K = nope 16 + rope 8, V 8
    ("gemma3n_text", 16, 16, [None, None, 0, 1]),  # the last two layers read the last sliding / full layer
    ("diffllama", 16, 16, [None] * 4),  # two attention calls per layer: four call sites for two layers
])
def test_per_layer_kv_spec(family, k_dim, v_dim, reuses):
    llm = LLM(tiny_model(family), block_size=4, num_kv_blocks=8, max_model_len=32)
    try:
        spec = llm.runner.kv_cache.spec
        assert [(layer.k_head_dim, layer.v_head_dim, layer.reuses) for layer in spec.layers] == \
            [(k_dim, v_dim, r) for r in reuses]
        owners = [spec.layers[i] for i in spec.owner_layers]
        assert spec.bytes_per_token == 4 * sum(l.k_heads * l.k_head_dim + l.v_heads * l.v_head_dim for l in owners)
        assert llm.runner.kv_cache.nbytes == 8 * spec.bytes_per_block  # reusing layers allocate nothing
    finally:
        llm.restore()


@pytest.mark.parametrize("family", UNSUPPORTED_FAMILIES)
def test_unsupported_models_are_refused_with_a_reason(family):
    model = tiny_model(family)
    with pytest.raises(UnsupportedModelError, match="attention"):
        LLM(model, block_size=4, num_kv_blocks=16, max_model_len=64)
    assert model.config._attn_implementation != "kvpage"  # left as it was


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_kv_runs_and_matches(dtype):
    """16-bit models keep 16-bit KV blocks (fp32 accumulation); greedy still follows HF here."""
    model = tiny_model("llama", dtype=dtype)
    prompts = _prompts(6, (3, 6, 13))
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    got, _ = _run(model, prompts, block_size=4, num_kv_blocks=48, max_model_len=64, max_num_batched_tokens=8)
    assert got == expected
