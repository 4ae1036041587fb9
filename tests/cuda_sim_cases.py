"""Simulator cases for the Numba CUDA kernels, run in a subprocess by ``test_cuda_sim.py``.

``NUMBA_ENABLE_CUDASIM=1`` only takes effect if it is set before ``numba.cuda`` is first
imported, which the main pytest process may already have done; so the parent spawns
``python -P tests/cuda_sim_cases.py`` with the variable set and reads one JSON line per
case. Importing this file (to list ``CASES``) imports neither numba nor the kernels.

Grids are tiny on purpose: the simulator runs one Python thread per CUDA thread.
Every case compares against ``kvpage.attention.reference`` with fp32/fp16 tolerances.
"""
from __future__ import annotations

import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

TOL = {np.float32: dict(rtol=1e-5, atol=1e-5), np.float16: dict(rtol=2e-3, atol=1e-3)}
THREADS = 16
BLOCK_SIZE = 4


@dataclass
class Batch:
    """A ragged batch: per sequence (query length, context length)."""

    shapes: list
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: type
    seed: int = 0
    num_blocks: Optional[int] = None
    arrays: dict = field(default_factory=dict)

    def build(self) -> "Batch":
        rng = np.random.default_rng(self.seed)
        q_lens = np.array([s[0] for s in self.shapes], np.int32)
        seq_lens = np.array([s[1] for s in self.shapes], np.int32)
        per_seq = -(-seq_lens // BLOCK_SIZE)
        max_blocks = int(per_seq.max())
        num_blocks = self.num_blocks or int(per_seq.sum()) + 3
        # Scattered, non-monotonic block ids; padding entries point at block 0 on purpose.
        perm = rng.permutation(num_blocks)
        tables = np.zeros((len(self.shapes), max_blocks), np.int32)
        used = 0
        for i, n in enumerate(per_seq.tolist()):
            tables[i, :n] = perm[used:used + n]
            used += n
        shape = (num_blocks, BLOCK_SIZE, self.num_kv_heads, self.head_dim)
        self.arrays = dict(
            q=rng.standard_normal((int(q_lens.sum()), self.num_heads, self.head_dim)).astype(self.dtype),
            key_cache=rng.standard_normal(shape).astype(self.dtype),
            value_cache=rng.standard_normal(shape).astype(self.dtype),
            query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
            seq_lens=seq_lens,
            block_tables=tables,
        )
        return self


def check_attention(batch: Batch, scaling: float = 0.35, sliding_window=None, softcap=None,
                    with_sinks: bool = False, **kernel_kwargs) -> str:
    from kvpage.attention import paged_attention_reference
    from kvpage.cuda import paged_attention

    b = batch.build()
    sinks = None
    if with_sinks:
        sinks = np.random.default_rng(b.seed + 1).standard_normal(b.num_heads).astype(np.float32) * 2
    args = dict(b.arrays, scaling=scaling, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    kernel_kwargs.setdefault("threads_per_block", THREADS)
    out = paged_attention(**args, **kernel_kwargs)
    ref = paged_attention_reference(**args)
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.dtype, ref.shape)
    np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), **TOL[b.dtype])
    return f"max_abs_err={float(np.abs(out.astype(np.float32) - ref.astype(np.float32)).max()):.3g}"


def check_store(dtype) -> str:
    from kvpage.attention import write_kv_reference
    from kvpage.cuda import store_kv

    rng = np.random.default_rng(7)
    shape = (5, BLOCK_SIZE, 2, 8)
    kc = rng.standard_normal(shape).astype(dtype)
    vc = rng.standard_normal(shape).astype(dtype)
    slots = rng.permutation(5 * BLOCK_SIZE)[:9].astype(np.int64)
    slots[4] = -1  # padding token: must be skipped
    k = rng.standard_normal((9, 2, 8)).astype(dtype)
    v = rng.standard_normal((9, 2, 8)).astype(dtype)
    kr, vr = kc.copy(), vc.copy()
    keep = slots >= 0
    write_kv_reference(kr, vr, k[keep], v[keep], slots[keep])
    store_kv(kc, vc, k, v, slots, threads_per_block=THREADS)
    np.testing.assert_array_equal(kc, kr)
    np.testing.assert_array_equal(vc, vr)
    return "exact"


def check_step_end_to_end() -> str:
    """store_kv + paged_attention on metadata from ``build_step_metadata`` (decodes first)."""
    from kvpage.attention import paged_attention_reference, write_kv_reference
    from kvpage.cuda import paged_attention, store_kv
    from kvpage.core.sched.metadata import build_step_metadata
    from kvpage.core.request import Request

    rng = np.random.default_rng(11)
    h, hkv, d, num_blocks = 4, 2, 8, 24
    # (prompt length, tokens already computed, tokens fed this step)
    plan = [(6, 5, 1), (9, 8, 1), (7, 4, 3), (5, 0, 5)]
    perm = iter(rng.permutation(num_blocks).tolist())
    reqs, feed = [], []
    for i, (n, computed, new) in enumerate(plan):
        r = Request(f"r{i}", list(range(1, n + 1)))
        r.num_computed_tokens = computed
        r.block_ids = [next(perm) for _ in range(-(-(computed + new) // BLOCK_SIZE))]
        reqs.append(r)
        feed.append(new)
    md = build_step_metadata(reqs, feed, BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, hkv, d)
    kc = rng.standard_normal(shape).astype(np.float32)
    vc = rng.standard_normal(shape).astype(np.float32)
    k = rng.standard_normal((md.num_tokens, hkv, d)).astype(np.float32)
    v = rng.standard_normal((md.num_tokens, hkv, d)).astype(np.float32)
    q = rng.standard_normal((md.num_tokens, h, d)).astype(np.float32)
    kr, vr = kc.copy(), vc.copy()
    write_kv_reference(kr, vr, k, v, md.slot_mapping)
    store_kv(kc, vc, k, v, md.slot_mapping, threads_per_block=THREADS)
    np.testing.assert_array_equal(kc, kr)
    meta = (md.query_start_loc, md.seq_lens, md.block_tables)
    out = paged_attention(q, kc, vc, *meta, 0.3, num_splits=2, kv_tile=2, threads_per_block=THREADS,
                          num_decodes=md.num_decodes, max_prefill_query_len=md.max_prefill_query_len, max_seq_len=md.max_seq_len)
    ref = paged_attention_reference(q, kr, vr, *meta, 0.3)
    np.testing.assert_allclose(out, ref, **TOL[np.float32])
    return f"num_decodes={md.num_decodes}"


F32, F16 = np.float32, np.float16
EDGE_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 2]


def _decode(lens, h, hkv, d, dtype, seed=0):
    return Batch([(1, n) for n in lens], h, hkv, d, dtype, seed)


CASES: dict[str, Callable[[], str]] = {
    "store_kv_fp32": lambda: check_store(F32),
    "store_kv_fp16": lambda: check_store(F16),
    "decode_mha_fp32_block_edges": lambda: check_attention(_decode(EDGE_LENS, 2, 2, 8, F32), num_splits=1, kv_tile=4),
    "decode_gqa_fp16_block_edges": lambda: check_attention(_decode(EDGE_LENS, 4, 2, 8, F16), num_splits=1, kv_tile=4),
    "decode_mqa_fp32_d16": lambda: check_attention(_decode([2, 7], 4, 1, 16, F32), num_splits=1, kv_tile=4),
    "decode_splitk_fp32": lambda: check_attention(_decode(EDGE_LENS, 4, 2, 8, F32, 1), num_splits=3, kv_tile=2),
    "decode_splitk_fp16_sinks": lambda: check_attention(_decode(EDGE_LENS, 4, 2, 8, F16, 2), num_splits=4,
                                                        kv_tile=2, with_sinks=True),
    "decode_sinks_nosplit_fp32": lambda: check_attention(_decode([1, 5], 4, 2, 8, F32, 3), num_splits=1,
                                                         kv_tile=4, with_sinks=True),
    "decode_window_splitk_fp32": lambda: check_attention(_decode(EDGE_LENS, 4, 2, 8, F32, 4), sliding_window=3,
                                                         num_splits=2, kv_tile=2),
    "decode_window_ge_ctx_fp32": lambda: check_attention(_decode([3, 5], 2, 2, 8, F32, 5), sliding_window=5,
                                                         num_splits=1, kv_tile=4),
    "decode_softcap_fp32": lambda: check_attention(_decode([4, 9], 4, 2, 8, F32, 6), softcap=1.5, scaling=1.0,
                                                   num_splits=1, kv_tile=4),
    "decode_all_features_fp16": lambda: check_attention(_decode(EDGE_LENS, 4, 2, 8, F16, 7), sliding_window=4,
                                                        softcap=2.0, with_sinks=True, num_splits=2, kv_tile=2),
    "decode_default_tile_and_splits_fp32": lambda: check_attention(_decode([5, 9], 4, 2, 8, F32, 8)),
    "decode_odd_threads_fp32": lambda: check_attention(_decode([6, 3], 4, 2, 8, F32, 9), num_splits=2, kv_tile=4,
                                                       threads_per_block=12),
    # Fewer threads than head_dim: each thread owns two elements d in the value pass.
    "decode_threads_below_head_dim_fp16": lambda: check_attention(_decode([5, 13], 4, 2, 32, F16, 17), num_splits=2,
                                                                  kv_tile=4, softcap=2.0),
    "prefill_full_fp32_block_edges": lambda: check_attention(
        Batch([(n, n) for n in EDGE_LENS[1:]], 2, 2, 8, F32, 10), kv_tile=4),
    "prefill_prefix_hit_gqa_fp32": lambda: check_attention(
        Batch([(2, 6), (5, 9), (3, 3), (1, 4)], 4, 2, 8, F32, 11), kv_tile=4),
    "prefill_prefix_hit_gqa_fp16": lambda: check_attention(
        Batch([(2, 6), (5, 9), (3, 3)], 4, 2, 16, F16, 12), kv_tile=4),
    "prefill_window_softcap_sinks_fp16": lambda: check_attention(
        Batch([(5, 9), (4, 4), (3, 7)], 4, 2, 8, F16, 13), sliding_window=3, softcap=2.0, with_sinks=True,
        kv_tile=2),
    "prefill_mqa_window_fp32": lambda: check_attention(
        Batch([(6, 8), (2, 2)], 4, 1, 8, F32, 14), sliding_window=4, kv_tile=4),
    "mixed_decode_then_prefill_fp32": lambda: check_attention(
        Batch([(1, 5), (1, 1), (1, 4), (3, 8), (1, 6), (4, 4)], 4, 2, 8, F32, 15), num_splits=2, kv_tile=2),
    "mixed_decode_then_prefill_fp16_sinks": lambda: check_attention(
        Batch([(1, 9), (2, 5), (3, 3)], 4, 2, 8, F16, 16), with_sinks=True, softcap=3.0, num_splits=3, kv_tile=2),
    "step_metadata_end_to_end": check_step_end_to_end,
}


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parent))  # run with -P: the tests folder, last
    from _cuda_subprocess import serve_cases

    sys.exit(serve_cases(CASES, sys.argv[1:]))
