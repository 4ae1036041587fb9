"""StepMetadata: flat arrays consistent with the block tables, exact values."""
from __future__ import annotations

import numpy as np

from kvpage import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig, build_step_metadata

BS = 4


def req(rid, tokens, computed, blocks) -> Request:
    r = Request(rid, tokens)
    r.num_computed_tokens = computed
    r.block_ids = list(blocks)
    return r


def test_exact_arrays_for_a_mixed_batch():
    decode = req("d", list(range(100, 106)), 5, [7, 3])  # 6 tokens, feeds the last one
    chunk = req("c", list(range(200, 210)), 0, [1, 4])  # 10-token prompt, first 6 only
    whole = req("w", [9, 8, 7], 0, [0])  # whole prompt
    m = build_step_metadata([decode, chunk, whole], [1, 6, 3], BS, [(5, 6)])

    assert m.num_tokens == 10 and m.num_seqs == 3 and m.num_decodes == 1
    assert m.input_ids.tolist() == [105, 200, 201, 202, 203, 204, 205, 9, 8, 7]
    assert m.positions.tolist() == [5, 0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert m.query_start_loc.tolist() == [0, 1, 7, 10]
    assert m.query_lens.tolist() == [1, 6, 3] and m.max_query_len == 6
    assert m.seq_lens.tolist() == [6, 6, 3] and m.max_seq_len == 6
    assert m.num_computed_tokens.tolist() == [5, 0, 0]
    # Padded block table: rows shorter than the longest are zero-padded.
    assert m.block_tables.tolist() == [[7, 3], [1, 4], [0, 0]]
    assert m.slot_mapping.tolist() == [
        3 * BS + 1,  # decode: position 5 -> block 3, offset 1
        1 * BS + 0, 1 * BS + 1, 1 * BS + 2, 1 * BS + 3, 4 * BS + 0, 4 * BS + 1,
        0, 1, 2,
    ]
    # The chunk does not reach the end of its prompt: no logits for it.
    assert m.logits_indices.tolist() == [0, 9]
    assert m.sample_seq_indices.tolist() == [0, 2]
    assert m.block_copies.tolist() == [[5, 6]]
    assert m.request_ids == ["d", "c", "w"]
    assert m.block_size == BS
    assert (m.input_ids.dtype, m.positions.dtype, m.slot_mapping.dtype) == (np.int64,) * 3
    assert (m.query_start_loc.dtype, m.seq_lens.dtype, m.block_tables.dtype) == (np.int32,) * 3
    assert m.logits_indices.dtype == np.int64 and m.block_copies.dtype == np.int64


def test_empty_batch():
    m = build_step_metadata([], [], BS)
    assert m.num_tokens == 0 and m.num_seqs == 0 and m.max_query_len == 0 and m.max_seq_len == 0
    assert m.query_start_loc.tolist() == [0]
    assert m.block_tables.shape == (0, 0) and m.block_copies.shape == (0, 2)
    assert m.logits_indices.size == 0


def check_consistent(m, requests, counts) -> None:
    """Every per-token array agrees with the requests' block tables."""
    qsl = m.query_start_loc.tolist()
    for i, (r, n) in enumerate(zip(requests, counts)):
        rows = range(qsl[i], qsl[i + 1])
        assert len(rows) == n
        start = int(m.num_computed_tokens[i])
        assert int(m.seq_lens[i]) == start + n
        for row, pos in zip(rows, range(start, start + n)):
            assert m.positions[row] == pos
            assert m.input_ids[row] == r.all_token_ids[pos]
            assert m.slot_mapping[row] == r.block_ids[pos // BS] * BS + pos % BS
        nb = len(r.block_ids)
        assert m.block_tables[i, :nb].tolist() == r.block_ids
        assert not m.block_tables[i, nb:].any()
        samples = m.sample_seq_indices.tolist()
        if start + n == r.num_tokens:
            assert m.logits_indices[samples.index(i)] == qsl[i + 1] - 1
        else:
            assert i not in samples
    # Decodes first.
    ql = m.query_lens.tolist()
    assert ql[: m.num_decodes] == [1] * m.num_decodes and 1 not in ql[m.num_decodes :]
    # No two tokens of the step write the same KV slot.
    assert len(set(m.slot_mapping.tolist())) == m.num_tokens


def test_scheduler_metadata_consistent_over_a_run():
    rng = np.random.default_rng(3)
    s = Scheduler(
        CacheConfig(block_size=BS, num_blocks=64),
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=64),
    )
    for i in range(10):
        s.make_request(f"r{i}", rng.integers(1, 50, size=int(rng.integers(1, 30))).tolist(),
                       SamplingParams(max_tokens=int(rng.integers(1, 10)), ignore_eos=True))
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        check_consistent(out.metadata, out.requests, out.num_new_tokens)
        s.update_from_output(out, rng.integers(1, 50, size=out.metadata.sample_seq_indices.shape[0]))
        steps += 1
        assert steps < 200
    assert s.pool.num_free_blocks == 64
