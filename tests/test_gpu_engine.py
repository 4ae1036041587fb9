"""The whole engine on a real GPU: CuPy KV buffers, Numba kernels, greedy output equal to HF.

Marked ``gpu``; skipped cleanly without a CUDA device visible to torch and CuPy.
"""
from __future__ import annotations

import pytest
import torch

from kvpage import LLM, SamplingParams
from kvpage.cuda.interop import gpu_unavailable_reason
from tiny_models import VOCAB, hf_greedy, tiny_model


def _gpu_reason():
    reason = gpu_unavailable_reason()  # "no GPU" first: the torch build matters only with a GPU
    if reason is None and not torch.cuda.is_available():
        return f"a GPU is present but torch {torch.__version__} has no CUDA support"
    return reason


_REASON = _gpu_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt2"])
def test_greedy_matches_hf_on_gpu_fp32(family):
    model = tiny_model(family).cuda()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 17, 33)]
    expected = [hf_greedy(model, p, 8) for p in prompts]
    llm = LLM(model, block_size=16, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=32)
    try:
        assert llm.runner.backend.name == "cuda"
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
    finally:
        llm.restore()


def test_gpu_memory_utilization_sizes_the_pool():
    model = tiny_model("llama").cuda()
    llm = LLM(model, block_size=16, gpu_memory_utilization=0.05, max_model_len=128)
    try:
        total = torch.cuda.get_device_properties(0).total_memory
        assert 0 < llm.stats()["num_blocks"] * llm.runner.kv_cache.spec.bytes_per_block <= 0.05 * total
    finally:
        llm.restore()


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: softcap, sliding and full KV groups
def test_decode_steps_replay_cuda_graphs_and_match_hf(family, monkeypatch):
    monkeypatch.setenv("KVPAGE_EXACT", "0")  # the default mode: decode steps replay CUDA graphs
    model = tiny_model(family).cuda()
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 17, 33, 9)]
    max_tokens = [4, 12, 7, 16, 9]  # sequences leave at different steps: the batch walks down the buckets
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]
    llm = LLM(model, block_size=16, num_kv_blocks=64, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32)
    try:
        graphs = llm.runner.decode_graphs
        assert graphs is not None, "decode graphs were not captured (see the engine's warning)"
        served = []
        run = graphs.run
        graphs.run = lambda metadata: served.append(metadata.num_seqs) or run(metadata)
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert len(served) >= 10, served
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
    finally:
        llm.restore()
