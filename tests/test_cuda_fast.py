"""The fast decode kernel (``kvpage.cuda.decode_fast``): static checks, simulator runs, real GPU.

* Split sizing (``fast_launch.fast_decode_splits``): pure arithmetic, checked here.
* PTX/ptxas (one subprocess, ``NUMBA_FORCE_CUDA_CC=9.0``): every variant's K/V loads are
  16-byte vector loads, no 16-bit global loads, no stack frame or spills, registers within
  ``fast_launch.register_budget(group)`` (the blocks per SM the variant is sized for), no fp64.
* Simulator (this file run as a script with ``NUMBA_ENABLE_CUDASIM=1``): the kernel itself, its
  16-byte loads, bit casts and shuffles swapped for numpy stand-ins, on tiny batches against
  ``paged_attention_reference`` (ragged lengths, split-K with the folded merge, windows,
  softcap, sinks, fp16 and bf16, block sizes that do and do not divide a warp's keys).
* Real GPU (``gpu`` marker, skipped without CuPy and a device): realistic shapes.
"""
from __future__ import annotations

import json
import sys
import time
import traceback

import numpy as np
import pytest

from kvpage.attention.reference import paged_attention_reference
from kvpage.cuda.fast_launch import (FAST_BLOCKS_PER_SM, FAST_MAX_SPLITS, FAST_MIN_PARTITION, MIN_WAVES, FastScratch,
                                     FastSplits, fast_decode_splits, launch_fast_decode, register_budget,
                                     scratch_shapes, split_ranges)

H200_SMS = 132
TOL = {"fp16": dict(rtol=3e-3, atol=2e-3), "bf16": dict(rtol=2e-2, atol=2e-2)}


# --- Split sizing ---

@pytest.mark.parametrize("num_seqs,num_kv_heads,context,block_size",
                         [(32, 8, 4096, 16), (32, 8, 16384, 16), (32, 1, 4096, 16), (1, 8, 131072, 16),
                          (4, 2, 1000, 4), (64, 8, 300, 16), (1, 1, 1, 16), (8, 4, 5000, 1)])
@pytest.mark.parametrize("group", sorted(FAST_BLOCKS_PER_SM))
def test_split_sizing_covers_every_key_once(num_seqs, num_kv_heads, context, block_size, group) -> None:
    blocks_per_sm = FAST_BLOCKS_PER_SM[group]
    splits = fast_decode_splits(num_seqs, num_kv_heads, context, H200_SMS, block_size, blocks_per_sm)
    assert splits.partition % block_size == 0
    assert 1 <= splits.num_splits <= FAST_MAX_SPLITS
    assert splits.num_splits * splits.partition >= context > (splits.num_splits - 1) * splits.partition
    if splits.num_splits > 1:
        assert splits.partition >= FAST_MIN_PARTITION - block_size
    wave = H200_SMS * blocks_per_sm
    blocks = num_seqs * num_kv_heads * splits.num_splits
    room = min(FAST_MAX_SPLITS, context // FAST_MIN_PARTITION)  # splits the context allows
    if num_seqs * num_kv_heads * room >= MIN_WAVES * wave:
        assert blocks >= MIN_WAVES * wave, "the context allows two full waves but the grid is smaller"
    for window in (0, 700):
        covered = [k for lo, hi in split_ranges(context, window, splits) for k in range(lo, hi)]
        lo = max(0, context - window) if window else 0
        assert covered == list(range(lo, context))


def test_split_sizing_target_shape() -> None:
    """Batch 32 x 8 kv heads, 4k context, group 4 on an H200: several waves, long partitions."""
    splits = fast_decode_splits(32, 8, 4096, H200_SMS, 16, FAST_BLOCKS_PER_SM[4])
    blocks = 32 * 8 * splits.num_splits
    wave = H200_SMS * FAST_BLOCKS_PER_SM[4]
    assert blocks >= 2 * wave and blocks / (-(-blocks // wave) * wave) > 0.9
    assert splits.partition >= 512


def test_register_budgets() -> None:
    assert [register_budget(g) for g in (1, 4, 8)] == [128, 168, 255]


# --- PTX / ptxas ---

@pytest.fixture(scope="module")
def ptx_rows() -> dict:
    pytest.importorskip("numba")
    from _cuda_subprocess import run_json_lines

    rows = run_json_lines(["-m", "kvpage.cuda.decode_fast", "--json"],
                          {"NUMBA_FORCE_CUDA_CC": "9.0", "NUMBA_ENABLE_CUDASIM": "0"}, timeout=900)
    if "skip" in rows[0]:
        pytest.skip(f"no CUDA compiler for PTX: {rows[0]['skip']}")
    return {row["name"]: row for row in rows}


def _variant_names() -> list[str]:
    return [f"fast_decode_d{d}_g{g}_{dt}" for d in (64, 128) for g in (1, 4, 8) for dt in ("fp16", "bf16")]


@pytest.mark.parametrize("name", _variant_names())
def test_fast_variant_ptx(ptx_rows: dict, name: str) -> None:
    row = ptx_rows[name]
    assert row["fast"] and row["sm90_target"]
    loads = row["global_loads"]
    # q (one per head) and, per unrolled step, one K and one V row slice: all 16-byte loads.
    assert loads.get("128", 0) >= row["group"] + 2 * 4, loads
    assert "16" not in loads and "8" not in loads, f"narrow global loads: {loads}"
    assert not row["fp64"], "fp64 arithmetic in the kernel"
    if row["ptxas"] is None:
        pytest.skip("ptxas not installed: no register/stack/spill numbers")
    assert row["stack_bytes"] == 0 and row["spill_bytes"] == 0, row["ptxas"]
    assert row["registers"] <= register_budget(row["group"]), row["ptxas"]
    assert row["smem_bytes"] * FAST_BLOCKS_PER_SM[row["group"]] <= 200 * 1024


def test_every_fast_variant_reported(ptx_rows: dict) -> None:
    assert sorted(ptx_rows) == sorted(_variant_names())


# --- Simulator: the kernel itself on tiny batches (this file as a script) ---

def _to_bits(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Float values as 16-bit words (bf16: values already exact in bf16)."""
    if kv_dtype == "fp16":
        return x.astype(np.float16).view(np.uint16)
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _from_bits(bits: np.ndarray, kv_dtype: str) -> np.ndarray:
    if kv_dtype == "fp16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def make_batch(lens, num_heads, num_kv_heads, head_dim, kv_dtype, block_size, seed=0) -> dict:
    """A decode batch (one query token per sequence) of values exact in ``kv_dtype``."""
    rng = np.random.default_rng(seed)
    seq_lens = np.array(lens, np.int32)
    per_seq = -(-seq_lens // block_size)
    num_blocks = int(per_seq.sum()) + 3
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(lens), int(per_seq.max())), np.int32)
    used = 0
    for i, n in enumerate(per_seq.tolist()):
        tables[i, :n] = perm[used:used + n]
        used += n

    def values(shape):
        return _from_bits(_to_bits(rng.standard_normal(shape).astype(np.float32), kv_dtype), kv_dtype)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return dict(q=values((len(lens), num_heads, head_dim)), key_cache=values(shape), value_cache=values(shape),
                query_start_loc=np.arange(len(lens) + 1, dtype=np.int32), seq_lens=seq_lens, block_tables=tables)


def run_fast(batch: dict, kv_dtype: str, splits: FastSplits, window=0, softcap=0.0, sinks=None, simulate=True,
             scaling=0.125) -> np.ndarray:
    """The fast kernel on host arrays (simulator) or CuPy arrays (GPU); returns fp32 host output."""
    from kvpage.cuda.decode_fast import fast_decode_kernel

    xp = np
    if not simulate:
        import cupy as xp
    num_tokens, num_heads, head_dim = batch["q"].shape
    num_kv_heads = batch["key_cache"].shape[2]
    bits = tuple(xp.asarray(_to_bits(batch[k], kv_dtype)).view(xp.uint32) for k in ("q", "key_cache", "value_cache"))
    meta = tuple(xp.asarray(batch[k]) for k in ("query_start_loc", "seq_lens", "block_tables"))
    shapes = scratch_shapes(num_tokens, num_heads, head_dim, len(batch["seq_lens"]), num_kv_heads, splits)
    scratch = FastScratch(xp.full(shapes["part_max"], np.nan, np.float32), xp.zeros(shapes["part_sum"], np.float32),
                          xp.zeros(shapes["part_acc"], np.float32), xp.zeros(shapes["counters"], np.int32),
                          xp.asarray(sinks if sinks is not None else np.zeros(1), dtype=np.float32))
    out = xp.zeros((num_tokens, num_heads, head_dim), np.uint16)
    kernel = fast_decode_kernel(head_dim, num_heads // num_kv_heads, kv_dtype, simulate)
    launch_fast_decode(kernel, bits, meta, scaling, window, softcap, sinks is not None, splits, out, scratch)
    counters = scratch.counters if simulate else scratch.counters.get()
    assert not np.any(counters), "the kernel must leave its counters at zero"
    return _from_bits(out if simulate else out.get(), kv_dtype)


def check_against_reference(batch: dict, kv_dtype: str, splits: FastSplits, window=0, softcap=0.0, sinks=None,
                            simulate=True) -> float:
    out = run_fast(batch, kv_dtype, splits, window, softcap, sinks, simulate)
    ref = paged_attention_reference(**batch, scaling=0.125, sliding_window=window or None, softcap=softcap or None,
                                    sinks=sinks).astype(np.float32)
    np.testing.assert_allclose(out, ref, **TOL[kv_dtype])
    return float(np.abs(out - ref).max())


SIM_CASES = {
    # name: (lens, heads, kv heads, head_dim, kv dtype, block size, splits, window, softcap, sinks).
    # A block covers 64 (head_dim 64) or 32 (128) keys per round of its 4 warps: contexts are
    # long enough for several rounds, so the online rescaling between rounds is exercised.
    "g4_d64_fp16_one_split": ([200, 5], 4, 1, 64, "fp16", 16, FastSplits(1, 208), 0, 0.0, False),
    "g4_d64_fp16_splitk": ([300, 3, 130], 4, 1, 64, "fp16", 16, FastSplits(3, 112), 0, 0.0, False),
    "g1_d64_bf16_window_cap_sinks_bs4": ([150, 9], 2, 2, 64, "bf16", 4, FastSplits(2, 52), 100, 5.0, True),
    "g1_d128_fp16_sinks_one_split_bs4": ([100], 1, 1, 128, "fp16", 4, FastSplits(1, 100), 0, 0.0, True),
    "g1_d64_fp16_bs1_two_page_passes": ([530], 1, 1, 64, "fp16", 1, FastSplits(1, 530), 0, 0.0, False),
}


def _run_sim_case(name: str) -> float:
    lens, h, hkv, d, dt, bs, splits, window, cap, with_sinks = SIM_CASES[name]
    batch = make_batch(lens, h, hkv, d, dt, bs, seed=len(name))
    sinks = np.random.default_rng(7).standard_normal(h).astype(np.float32) if with_sinks else None
    return check_against_reference(batch, dt, splits, window, cap, sinks, simulate=True)


def _sim_main() -> int:
    for name in SIM_CASES:
        t0 = time.time()
        try:
            err = _run_sim_case(name)
            row = {"name": name, "ok": True, "detail": f"max |err| {err:.2e}"}
        except Exception:  # reported to the parent test, which fails with the traceback
            row = {"name": name, "ok": False, "detail": traceback.format_exc()[-3000:]}
        row["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)
    return 0


@pytest.fixture(scope="module")
def sim_rows() -> dict:
    pytest.importorskip("numba")
    from _cuda_subprocess import TESTS_DIR, run_json_lines

    rows = run_json_lines([str(TESTS_DIR / "test_cuda_fast.py"), "--sim"], {"NUMBA_ENABLE_CUDASIM": "1"},
                          timeout=900)
    return {row["name"]: row for row in rows}


@pytest.mark.parametrize("name", sorted(SIM_CASES))
def test_fast_kernel_in_simulator(sim_rows: dict, name: str) -> None:
    row = sim_rows[name]
    assert row["ok"], row["detail"]


# --- Real GPU ---

def _gpu_reason():
    from kvpage.cuda.interop import gpu_unavailable_reason

    return gpu_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("group,head_dim", [(4, 128), (8, 128), (1, 64)])
def test_fast_kernel_on_gpu(kv_dtype: str, group: int, head_dim: int) -> None:
    reason = _gpu_reason()
    if reason is not None:
        pytest.skip(reason)
    from numba import cuda

    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    lens = [1, 15, 16, 17, 700, 2049, 4100, 129]
    batch = make_batch(lens, 4 * group, 4, head_dim, kv_dtype, 16, seed=group)
    sinks = np.random.default_rng(3).standard_normal(4 * group).astype(np.float32)
    for window, cap, with_sinks in ((0, 0.0, False), (512, 30.0, True)):
        context = min(max(lens), window) if window else max(lens)
        for splits in (fast_decode_splits(len(lens), 4, context, sms, 16, FAST_BLOCKS_PER_SM[group]),
                       FastSplits(1, -(-context // 16) * 16)):
            check_against_reference(batch, kv_dtype, splits, window, cap, sinks if with_sinks else None,
                                    simulate=False)


if __name__ == "__main__" and "--sim" in sys.argv:
    sys.exit(_sim_main())
