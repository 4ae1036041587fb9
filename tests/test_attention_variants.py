"""Attention variants beyond causal/sliding masks: chunked attention (Llama 4: a query at
position p sees keys j with (p // C) * C <= j <= p) and ALiBi (Bloom, MPT: head h adds
``slope[h] * j`` to the score of key position j).

The numpy reference is checked against a dense brute force, the torch path and the CPU
dispatcher against the reference, and a tiny Llama 4 (chunked, NoPE and full layers)
against HF ``generate`` under chunked prefill and preemption (the ALiBi families run end
to end in ``test_attention_ports``).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpage import LLM, SamplingParams
from kvpage.attention import paged_attention_reference
from kvpage.attention.cpu import paged_attention_cpu
from kvpage.attention.reference import gather_context
from kvpage.attention.torch_cpu import paged_attention_torch
from kvpage.storage.spec import KVCacheSpec, LayerKVSpec
from test_attention_cpu import BS, SCALE, SCENARIOS, make_case
from tiny_models import hf_greedy

CHUNK = 12  # not a multiple of the block size: chunk edges fall inside blocks


def _brute_force(q, kc, vc, qsl, lens, tables, chunk, slopes=None):
    out = np.zeros((q.shape[0], q.shape[1], vc.shape[3]), np.float32)
    group = q.shape[1] // kc.shape[2]
    for i, seq_len in enumerate(lens.tolist()):
        keys = np.repeat(gather_context(kc, tables[i], seq_len), group, axis=1)
        values = np.repeat(gather_context(vc, tables[i], seq_len), group, axis=1)
        start, end = int(qsl[i]), int(qsl[i + 1])
        for row in range(start, end):
            p = seq_len - (end - row)
            lo = p // chunk * chunk
            scores = np.einsum("hd,shd->hs", q[row], keys[lo:p + 1]) * SCALE
            if slopes is not None:
                scores = scores + slopes[:, None] * np.arange(lo, p + 1)[None, :]
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            out[row] = np.einsum("hs,shd->hd", weights, values[lo:p + 1])
    return out


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_reference_masks_by_chunk(scenario):
    case = make_case(np.random.default_rng(1), *SCENARIOS[scenario])
    want = _brute_force(*case, CHUNK)
    got = paged_attention_reference(*case, SCALE, attention_chunk=CHUNK)
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-5)
    if max(SCENARIOS[scenario][1]) > CHUNK:  # the chunk mask changed something
        assert not np.allclose(got, paged_attention_reference(*case, SCALE), atol=1e-3)


SLOPES = (0.5 ** np.arange(1, 9)).astype(np.float32)  # one per query head (make_case has 8)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_reference_adds_alibi(scenario):
    case = make_case(np.random.default_rng(4), *SCENARIOS[scenario])
    big_chunk = 10**6  # no chunking: the brute force's chunk mask is then plain causal
    want = _brute_force(*case, big_chunk, SLOPES)
    np.testing.assert_allclose(paged_attention_reference(*case, SCALE, alibi_slopes=SLOPES), want,
                               atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("option", [{}, {"sliding_window": 5}, {"softcap": 4.0}, {"alibi_slopes": SLOPES},
                                    {"alibi_slopes": SLOPES, "attention_chunk": None}])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_torch_and_dispatcher_match_the_reference(scenario, option):
    q, kc, vc, qsl, lens, tables = make_case(np.random.default_rng(2), *SCENARIOS[scenario])
    option = {"attention_chunk": CHUNK, **option}
    want = paged_attention_reference(q, kc, vc, qsl, lens, tables, SCALE, **option)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, kc, vc))
    torch_option = dict(option)
    if "alibi_slopes" in option:
        torch_option["alibi_slopes"] = torch.from_numpy(option["alibi_slopes"])
    got = paged_attention_torch(tq, tk, tv, qsl, lens, tables, SCALE, **torch_option)
    np.testing.assert_allclose(got.numpy(), want, atol=3e-5, rtol=1e-5)
    dispatched = paged_attention_cpu(tq, tk, tv, qsl, lens, tables, SCALE, **option)
    np.testing.assert_allclose(dispatched.numpy(), want, atol=3e-5, rtol=1e-5)


def test_chunked_layers_are_refused_on_cuda():
    from kvpage.engine.builder import check_backend_fits
    from kvpage.adapters.hf_runner import UnsupportedModelError

    spec = KVCacheSpec((LayerKVSpec.symmetric(2, 8), LayerKVSpec(2, 8, 2, 8, attention_chunk=8)), block_size=BS)
    check_backend_fits(spec, "cpu")
    with pytest.raises(UnsupportedModelError, match="layer 1 attends in chunks of 8"):
        check_backend_fits(spec, "cuda")


# ---------------------------------------------------------------------- Llama 4 end to end


def _llama4():
    import transformers as tf

    from kvpage.tools.census.tiny_config import tiny_config

    torch.manual_seed(0)
    config = tiny_config(tf.Llama4TextConfig)
    config.attention_chunk_size = 8
    return tf.Llama4ForCausalLM._from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("options", [
    dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=6),  # chunk edges inside prefill chunks
    dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=16),  # preemption and recomputation
    dict(block_size=16, num_kv_blocks=64, enable_chunked_prefill=False),
])
def test_llama4_matches_hf_generate(options):
    model = _llama4()
    assert "chunked_attention" in model.config.layer_types
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]
    expected = [hf_greedy(model, p, 10) for p in prompts]
    llm = LLM(model, max_model_len=48, **options)
    try:
        chunks = [layer.attention_chunk for layer in llm.engine.runner.layer_specs]
        assert 8 in chunks and None in chunks  # chunked and full layers
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
    finally:
        llm.restore()


def test_temperature_tuning_bounds_the_context():
    """Llama 4's NoPE layers count positions themselves: exact only below floor_scale - 1."""
    model = _llama4()
    floor_scale = model.config.floor_scale = 32  # below the tiny model's 256 positions
    with pytest.raises(ValueError, match=f"up to {floor_scale - 1} tokens"):
        LLM(model, max_model_len=floor_scale + 1, block_size=16, num_kv_blocks=1024)
    assert model.config._attn_implementation != "kvpage"
    llm = LLM(model, block_size=16, num_kv_blocks=1024, max_num_batched_tokens=16)  # no max_model_len: capped
    try:
        assert llm.max_model_len == floor_scale - 1
    finally:
        llm.restore()
