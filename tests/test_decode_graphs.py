"""Decode steps replayed from captured graphs (``kvpage.adapters.decode_graphs``), on CPU.

A real CUDA graph needs a GPU (``tests/test_gpu_engine.py`` captures them there). Here the
capture is ``RerunCapture``, which replays by running the captured closure again: what it
checks is everything around the graph, the persistent buffers, the padding rows, the
bucket choice, the hybrid groups' tables and the runner's routing, through a backend whose
graphed decode reads only those buffers. Greedy output must equal HF ``generate``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpage import LLM, SamplingParams
from kvpage.adapters.attention_backends import CpuBackend, register_attention_backend
from kvpage.adapters.decode_graphs import (GraphedStepIndices, RerunCapture, StaticDecodeBuffers, bucket_for,
                                           capture_sizes)
from tiny_models import VOCAB, hf_greedy, tiny_model


def test_capture_sizes_are_powers_of_two_then_multiples_of_eight_up_to_the_batch_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert capture_sizes(1000)[-3:] == [240, 248, 256]
    assert capture_sizes(64, limit=20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(32)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 9, 17, 32, 33)] == [1, 4, 8, 16, 24, 32, None]


def test_staging_pads_rows_past_the_step_with_no_store_and_no_context():
    buffers = StaticDecodeBuffers(max_seqs=8, num_groups=2, table_width=5, device=torch.device("cpu"))
    tables = [np.array([[3, 4], [5, 6], [7, 8]], np.int32), np.array([[9], [10], [11]], np.int32)]
    slots = [np.array([13, 21, 30]), np.array([37, 41, 45])]
    buffers.stage(np.array([5, 6, 7]), np.array([9, 10, 11]), slots, np.array([10, 11, 12], np.int32), tables, 4)
    ids, positions, rows = buffers.inputs(4)
    assert ids.tolist() == [5, 6, 7, 0] and positions.tolist() == [9, 10, 11, 0] and rows.tolist() == [0, 1, 2, 3]
    group0, group1 = buffers.indices(4, max_seq_len=20)
    assert group0.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert group0.seq_lens.tolist() == [10, 11, 12, 0] and group1.seq_lens.tolist() == [10, 11, 12, 0]
    assert group0.slot_mapping.tolist() == [13, 21, 30, -1] and group1.slot_mapping.tolist() == [37, 41, 45, -1]
    assert group0.block_tables[:3, :2].tolist() == tables[0].tolist()
    assert group1.block_tables[:3, :1].tolist() == tables[1].tolist()
    assert (group0.num_seqs, group0.max_seq_len) == (4, 20)
    # A smaller step next: the rows it no longer uses become padding again.
    buffers.stage(np.array([1]), np.array([2]), [s[:1] for s in slots], np.array([3], np.int32),
                  [t[:1] for t in tables], 2)
    assert buffers.indices(2, 20)[0].seq_lens.tolist() == [3, 0]
    assert buffers.indices(2, 20)[1].slot_mapping.tolist() == [37, -1]


def _dense_decode(q, key_cache, value_cache, indices: GraphedStepIndices, scaling, window, softcap):
    """Decode attention from the persistent buffers alone, with fixed shapes (as a graph runs):
    every row gathers its table's blocks and masks the keys past its context."""
    num_seqs, width = indices.block_tables.shape
    block_size, num_kv, head_dim = key_cache.shape[1:]
    keys = key_cache[indices.block_tables.long()].reshape(num_seqs, width * block_size, num_kv, head_dim)
    values = value_cache[indices.block_tables.long()].reshape(num_seqs, width * block_size, num_kv, head_dim)
    group = q.shape[1] // num_kv
    keys, values = keys.repeat_interleave(group, dim=2), values.repeat_interleave(group, dim=2)
    scores = torch.einsum("nhd,nkhd->nhk", q.float(), keys.float()) * scaling
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    position = torch.arange(width * block_size)
    lens = indices.seq_lens.long()[:, None]
    visible = position[None, :] < lens
    if window:
        visible &= position[None, :] >= lens - window
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a padding row sees no key
    return torch.einsum("nhk,nkhd->nhd", weights, values.float()).to(q.dtype)


class GraphedTestBackend(CpuBackend):
    """The CPU backend for eager steps, plus a graphed decode that reads only the buffers."""

    name = "test-graphed"

    def prepare_graphed(self, indices: GraphedStepIndices) -> GraphedStepIndices:
        return indices

    def write_and_attend(self, q, k, v, key_cache, value_cache, prepared, scaling, sliding_window, softcap, sinks,
                         write=True):
        if not isinstance(prepared, GraphedStepIndices):
            return super().write_and_attend(q, k, v, key_cache, value_cache, prepared, scaling, sliding_window,
                                            softcap, sinks, write)
        assert sinks is None
        if write:
            stored = prepared.slot_mapping >= 0
            slots = prepared.slot_mapping[stored]
            key_cache.view(-1, *key_cache.shape[2:])[slots] = k[stored]
            value_cache.view(-1, *value_cache.shape[2:])[slots] = v[stored]
        return _dense_decode(q, key_cache, value_cache, prepared, scaling, sliding_window, softcap)


register_attention_backend("test-graphed", GraphedTestBackend)


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: softcap, sliding and full KV groups
def test_replayed_decode_steps_equal_hf_generate(family):
    model = tiny_model(family)
    prompts = _prompts(1, [5, 9, 17, 3, 12, 30])
    max_tokens = [6, 14, 9, 20, 3, 11]  # sequences leave at different steps: the batch walks down the buckets
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]
    llm = LLM(model, attention_backend="test-graphed", max_model_len=64, max_num_seqs=6, block_size=4,
              num_kv_blocks=160)
    try:
        runner = llm.runner
        runner.capture_decode_graphs(6, 64, capture=RerunCapture())
        graphs = runner.decode_graphs
        assert graphs.sizes == [1, 2, 4, 6] and graphs.buffers.num_groups == (2 if family == "gemma2" else 1)
        served = []
        run = graphs.run
        graphs.run = lambda metadata: served.append(metadata.num_seqs) or run(metadata)
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
        outputs = llm.generate(prompts, params)
        assert [out.outputs[0].token_ids for out in outputs] == expected
        assert len(served) >= max(max_tokens) - 2 and {1, 3, 5, 6} & set(served), served
        assert llm.stats()["decode_graph_steps"] == len(served)
        llm.check_integrity()
    finally:
        llm.restore()


def test_a_graph_that_froze_its_inputs_fails_the_check_at_capture():
    model = tiny_model("llama")
    llm = LLM(model, attention_backend="test-graphed", max_model_len=32, max_num_seqs=2, block_size=4,
              num_kv_blocks=32)

    class FrozenCapture(RerunCapture):
        """Replays the logits the capture computed, as a graph would whose inputs were copied in."""

        def capture(self, fn):
            logits = fn().clone()
            return lambda: logits

    try:
        with pytest.raises(RuntimeError, match="does not reproduce its eager forward"):
            llm.runner.capture_decode_graphs(2, 32, capture=FrozenCapture())
    finally:
        llm.restore()


def test_backends_without_a_graphed_decode_are_refused_with_the_reason():
    llm = LLM(tiny_model("llama"), max_model_len=32, max_num_seqs=2, block_size=4, num_kv_blocks=32)
    try:
        assert "CUDA graphs need the model on a CUDA device" in llm.runner.graph_refusal()
        assert "cpu attention backend has no graphed decode" in llm.runner.graph_refusal(RerunCapture())
        with pytest.raises(ValueError, match="decode graphs: the cpu attention backend"):
            llm.runner.capture_decode_graphs(2, 32, capture=RerunCapture())
    finally:
        llm.restore()


def test_the_start_up_log_names_the_captured_graphs():
    from kvpage.entrypoints.openai.startup import mode_summary

    llm = LLM(tiny_model("llama"), attention_backend="test-graphed", max_model_len=32, max_num_seqs=4,
              block_size=4, num_kv_blocks=32)
    try:
        assert mode_summary(llm.runner).startswith("mode: exact")
        llm.runner.capture_decode_graphs(4, 32, capture=RerunCapture())
        assert "decode steps of 1-4 sequences replayed from 3 CUDA graphs" in mode_summary(llm.runner)
    finally:
        llm.restore()
