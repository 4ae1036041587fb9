"""DeepSeek sparse attention (DSA): indexer keys paged beside the KV, top-k picks equal to HF's.

Tiny configs come from the census's shrinker (``index_topk`` 4, so prompts of 8-19 tokens
attend sparsely); greedy output must equal HF ``generate`` token for token.
"""
from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip("transformers")

from kvpage import LLM, SamplingParams  # noqa: E402
from kvpage.adapters.hf_runner import HFModelRunner  # noqa: E402
from kvpage.adapters.sparse_indexer import IndexerPort  # noqa: E402
from kvpage.attention.torch_cpu import paged_attention_torch, selected_attention_torch  # noqa: E402
from kvpage.tools.census.compare import census_prompts, compare_with_hf, hf_reference  # noqa: E402
from kvpage.tools.census.tiny_config import tiny_config  # noqa: E402
from kvpage.storage.spec import LayerKVSpec  # noqa: E402

FAMILIES = {
    "deepseek_v32": (tf.DeepseekV32Config, tf.DeepseekV32ForCausalLM),  # half-split rotary in the indexer
    "glm_moe_dsa": (tf.GlmMoeDsaConfig, tf.GlmMoeDsaForCausalLM),  # interleaved rotary in the indexer
}


def _model(family: str, **overrides):
    config_class, model_class = FAMILIES[family]
    config = tiny_config(config_class)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    return model_class._from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dsa_matches_hf_with_chunks_prefix_hits_and_preemption(family):
    model = _model(family)
    assert model.config.index_topk < 8  # the census prompts are longer: attention is sparse
    prompts = census_prompts(model.config.vocab_size)
    results = compare_with_hf(model, prompts, max_new_tokens=8, max_model_len=48)
    for mode, result in results.items():
        assert result.status == "exact", (mode, result.difference)
    assert results["stress"].stats["prefix_cache_hits"] > 0
    assert results["stress"].stats["preemptions"] > 0
    assert not any(isinstance(m, IndexerPort) for m in model.modules())  # the engine put the indexers back


def test_indexer_keys_are_a_keys_only_site_before_the_layers_attention():
    model = _model("deepseek_v32")
    runner = HFModelRunner(model)
    try:
        index_dim = model.config.index_head_dim
        layers = model.config.num_hidden_layers
        assert len(runner.layer_specs) == 2 * layers
        for site in range(0, 2 * layers, 2):
            assert runner.layer_specs[site] == LayerKVSpec(1, index_dim, 1, 0)
            assert runner.layer_specs[site + 1].v_head_dim == model.config.v_head_dim
        assert runner.compile() == 0.0 and runner.compiled is None  # DSA steps stay eager
    finally:
        runner.restore()
    assert not any(isinstance(m, IndexerPort) for m in model.modules())


def test_picks_equal_hf_at_exact_score_ties_whatever_the_chunking():
    """Two index heads: many keys score exactly 0 (both ReLUs zero), so the top-k breaks
    ties, which ``torch.topk`` does by row length. Rows as long as HF's (the prompt's, for
    prompt tokens) keep the picks equal to HF's under chunked prefill too."""
    model = _model("deepseek_v32", index_n_heads=2)
    prompts = census_prompts(model.config.vocab_size)
    expected, _ = hf_reference(model, prompts, 8)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for options in (dict(enable_chunked_prefill=False), dict(enable_chunked_prefill=True, max_num_batched_tokens=5)):
        llm = LLM(model, dtype="float32", max_model_len=48, block_size=4, num_kv_blocks=64,
                  enable_prefix_caching=False, **options)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.restore()
        assert [list(o.outputs[0].token_ids) for o in outs] == expected, options


def _paged(num_blocks=12, block_size=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    return k, v


def test_selected_attention_attends_exactly_the_picked_causal_keys():
    key_cache, value_cache = _paged()
    g = torch.Generator().manual_seed(1)
    seq_lens, q_lens = [9, 6], [3, 1]  # a chunk of 3 over 9 tokens, then a decode over 6
    tables = torch.tensor([[3, 7, 1], [5, 0, 0]])
    qsl = torch.tensor([0, 3, 4])
    q = torch.randn(4, 4, 8, generator=g)
    selection = torch.tensor([[0, 3, 8, -1], [6, 1, 7, 8], [2, 8, -1, -1], [5, 0, 2, -1]])
    out = selected_attention_torch(q, key_cache, value_cache, qsl, torch.tensor(seq_lens), tables, selection, 0.3)
    for seq, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        rows = key_cache[tables[seq]].reshape(-1, 2, 8)[:seq_len], value_cache[tables[seq]].reshape(-1, 2, 8)[:seq_len]
        for i in range(q_len):
            t = int(qsl[seq]) + i
            position = seq_len - q_len + i
            keys = sorted({int(p) for p in selection[t] if 0 <= p <= position})
            for head in range(4):
                k, v = rows[0][keys, head // 2], rows[1][keys, head // 2]
                weights = torch.softmax(k @ q[t, head] * 0.3, dim=0)
                torch.testing.assert_close(out[t, head], weights @ v, rtol=1e-5, atol=1e-5)


def test_selecting_every_key_is_dense_attention():
    key_cache, value_cache = _paged(seed=2)
    q = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(3))
    qsl, seq_lens, tables = torch.tensor([0, 1, 5]), torch.tensor([7, 10]), torch.tensor([[2, 9, 0], [4, 1, 6]])
    everything = torch.arange(10).expand(5, 10)
    sparse = selected_attention_torch(q, key_cache, value_cache, qsl, seq_lens, tables, everything, 0.25)
    dense = paged_attention_torch(q, key_cache, value_cache, qsl, seq_lens, tables, 0.25)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tiers", [{}, dict(kv_offloading_size=0.001)])
def test_prompts_submitted_together_and_the_host_tier(tiers, tmp_path):
    """All prompts in one call: a prompt hits the prefix blocks another fills in the same
    step, so every indexer key must be stored before any is read. With the host tier the
    indexer's keys-only blocks travel like KV (the disk tier takes one K-and-V-alike
    layout only, so MLA models are refused it)."""
    model = _model("deepseek_v32")
    prompts = census_prompts(model.config.vocab_size)
    expected, _ = hf_reference(model, prompts, 8)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(model, dtype="float32", max_model_len=48, block_size=4, num_kv_blocks=14, max_num_batched_tokens=9,
              **tiers)
    try:
        rounds = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
                  for _ in range(2)]
        stats = llm.stats()
    finally:
        llm.engine.close()
        llm.restore()
    assert rounds == [expected, expected]
    assert stats["prefix_cache_hits"] > 0
    if tiers:
        assert stats["kv_host_loads"] > 0
    with pytest.raises(ValueError, match="disk KV tier"):
        LLM(model, dtype="float32", max_model_len=48, block_size=4, kv_disk_cache=str(tmp_path / "kv"))
    assert not any(isinstance(m, IndexerPort) for m in model.modules())
